#!/usr/bin/env bash
# Two `trioserve serve` instances behind nginx on the loopback address, and a
# few streaming requests through nginx (docs/deployment.md).
#
#   scripts/nginx_lb.sh                # prints what it does; exit 0 when every stream completed
#   REQUESTS=8 scripts/nginx_lb.sh     # more requests
#   SERVE_ARGS="--model /path/to/x.gguf" scripts/nginx_lb.sh
#
# Everything it starts (both servers and nginx) is stopped when it exits,
# also on failure or Ctrl-C. Needs nginx: `apt-get install -y nginx`
# (scripts/setup.sh installs it where apt-get is available), or NGINX=/path/to/nginx.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
REQUESTS=${REQUESTS:-6}
# Small engines: two of them fit beside other work on a small machine.
SERVE_ARGS=${SERVE_ARGS:---kv-cache-memory 64M --max-model-len 512 --max-num-seqs 8 --num-threads 1}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}

NGINX=${NGINX:-$(command -v nginx || true)}
if [ -z "$NGINX" ] && [ -x /usr/sbin/nginx ]; then
    NGINX=/usr/sbin/nginx
fi
if [ -z "$NGINX" ] || [ ! -x "$NGINX" ]; then
    echo "nginx_lb.sh: nginx is not installed. Install it with 'apt-get install -y nginx' (Debian/Ubuntu)," >&2
    echo "'dnf install nginx' (Fedora) or 'brew install nginx' (macOS), or set NGINX=/path/to/nginx." >&2
    exit 3
fi

WORK=$(mktemp -d -t trioserve-nginx.XXXXXX)
PIDS=()

stop_all() {
    local status=$?
    trap - EXIT INT TERM
    # SIGTERM first: the servers drain (docs/api.md), nginx stops at once.
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 1 150); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "nginx_lb.sh: process $pid did not stop on SIGTERM within 15 s; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    if [ "$status" -ne 0 ]; then
        echo "nginx_lb.sh: failed (status $status); logs:" >&2
        for log in "$WORK"/*.log; do
            [ -f "$log" ] && { echo "--- $log (last lines)" >&2; tail -n 20 "$log" >&2; }
        done
    fi
    rm -rf "$WORK"
    exit "$status"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Three free loopback ports: two servers and nginx.
read -r PORT_A PORT_B PORT_LB < <("$PYTHON" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
for s in socks:
    s.close()
EOF
)

for port in "$PORT_A" "$PORT_B"; do
    # shellcheck disable=SC2086  # SERVE_ARGS is a list of options
    "$PYTHON" -m trioserve.web.cli --log-level WARNING serve --host 127.0.0.1 --port "$port" $SERVE_ARGS \
        >"$WORK/server-$port.log" 2>&1 &
    PIDS+=($!)
    echo "started trioserve serve on 127.0.0.1:$port (pid $!)"
done

# Open-source nginx has no active health checks (NGINX Plus's health_check):
# this script waits on each instance's /health itself before nginx starts, and
# nginx then takes a failing instance out by max_fails / fail_timeout.
"$PYTHON" - "$STARTUP_TIMEOUT" "$PORT_A:${PIDS[0]}" "$PORT_B:${PIDS[1]}" <<'EOF'
import os, sys, time
import httpx

def alive(pid):
    if os.path.isdir("/proc"):  # a zombie counts as gone
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

deadline = time.monotonic() + float(sys.argv[1])
for item in sys.argv[2:]:
    port, pid = item.split(":")
    while True:
        if not alive(int(pid)):
            sys.exit(f"the server on 127.0.0.1:{port} (pid {pid}) exited while starting")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                print(f"127.0.0.1:{port}/health: ready")
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"127.0.0.1:{port} did not become ready in {sys.argv[1]} s")
        time.sleep(0.5)
EOF

# The configuration of docs/deployment.md, on these ports, with every path
# under $WORK so that no root and no system nginx is involved.
cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log warn;
events { worker_connections 1024; }
http {
    access_log $WORK/nginx-access.log;
    client_body_temp_path $WORK/client_body;
    proxy_temp_path $WORK/proxy;
    fastcgi_temp_path $WORK/fastcgi;
    uwsgi_temp_path $WORK/uwsgi;
    scgi_temp_path $WORK/scgi;

    upstream trioserve {
        least_conn;
        server 127.0.0.1:$PORT_A max_fails=3 fail_timeout=10s;
        server 127.0.0.1:$PORT_B max_fails=3 fail_timeout=10s;
        keepalive 16;
    }

    server {
        listen 127.0.0.1:$PORT_LB;
        client_max_body_size 16m;

        location / {
            proxy_pass http://trioserve;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host \$host;
            proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
            proxy_buffering off;
            proxy_cache off;
            proxy_request_buffering off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
            proxy_connect_timeout 5s;
            proxy_next_upstream error timeout;
        }
    }
}
EOF
"$NGINX" -t -p "$WORK" -c "$WORK/nginx.conf" 2>"$WORK/nginx-check.log" || { cat "$WORK/nginx-check.log" >&2; exit 1; }
"$NGINX" -p "$WORK" -c "$WORK/nginx.conf" >"$WORK/nginx.log" 2>&1 &
PIDS+=($!)
echo "started nginx on 127.0.0.1:$PORT_LB (pid $!), least_conn over both"

"$PYTHON" - "$PORT_LB" "$PORT_A" "$PORT_B" "$REQUESTS" <<'EOF'
import sys, time
import anyio
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

lb, ports, count = sys.argv[1], sys.argv[2:4], int(sys.argv[4])

def successes(port):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "trioserve:request_success_total")

async def main():
    deadline = time.monotonic() + 30
    while True:  # nginx is up once it answers /health through to a server
        try:
            if httpx.get(f"http://127.0.0.1:{lb}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit("nginx did not answer in 30 s")
        await anyio.sleep(0.2)
    before = [successes(p) for p in ports]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{lb}/v1", api_key="unused", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    results = {}

    async def one(i):
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=16,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
        )
        text, finish, chunks = [], None, 0
        async for chunk in stream:
            chunks += 1
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        results[i] = ("".join(text), finish, chunks)

    async with anyio.create_task_group() as group:
        for i in range(count):
            group.start_soon(one, i)
    for i in range(count):
        text, finish, chunks = results[i]
        print(f"stream {i}: {chunks} chunks, finish_reason={finish}: {text[:60]!r}")
        if finish not in ("stop", "length") or not text or chunks < 2:
            sys.exit(f"stream {i} did not complete: finish_reason={finish}, {chunks} chunks")
    served = [successes(p) - b for p, b in zip(ports, before)]
    print(f"served per instance: {dict(zip(ports, served))}")
    if sum(served) != count:
        sys.exit(f"the instances counted {sum(served)} requests, not {count}")
    if count >= 2 and min(served) == 0:
        sys.exit("least_conn sent every request to one instance")
    print(f"ok: {count} streams through nginx on 127.0.0.1:{lb}")

anyio.run(main)
EOF
