"""An example of each trioserve plugin hook (see pyproject.toml's entry points).

Every hook here is a plain function or class: trioserve finds it through
its entry point and calls it as docs/api.md ("Plugins") describes. The
request fields it reads (``example_*``) are extra fields of the request
body; trioserve's parser ignores fields it does not know.
"""
