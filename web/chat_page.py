"""The chat page: one static HTML file (``static/chat.html``) at ``/`` and ``/chat``.

The page is plain HTML and JavaScript with nothing to build and nothing
fetched from elsewhere; it talks to the server's own ``/v1/models`` and
``/v1/chat/completions`` (docs/api.md, "The chat page"). It is served without
the API key (``routes.OPEN_PATHS``): it holds no data, and asks for the key
when the API answers 401.
"""

from __future__ import annotations

from importlib import resources

from quart import Quart, Response

PATHS = ("/", "/chat")

# The page's script and styles are inline; it may reach only this server.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def page_html() -> bytes:
    """The page's bytes, as installed with the package."""
    return resources.files("trioserve.web").joinpath("static", "chat.html").read_bytes()


def register(app: Quart) -> None:
    """Serve the page at each of ``PATHS``; the file is read once, here."""
    html = page_html()

    async def chat_page() -> Response:
        return Response(html, content_type="text/html; charset=utf-8", headers=_HEADERS)

    for path in PATHS:
        app.add_url_rule(path, endpoint=f"chat_page{path.replace('/', '_')}", view_func=chat_page, methods=["GET"])
