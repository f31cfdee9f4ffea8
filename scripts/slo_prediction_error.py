"""How good the latency model's predictions are (docs/reliability.md,
"Latency objectives"): bench/slo.py's mix of classes sent at each rate to a
fresh `trioserve serve --scheduling-policy slo --max-num-seqs 8` (the
default model), every request in best effort so that each is admitted and
predicted, and per request the predicted and measured TTFT and TPOT from
its `usage.slo`; prints the relative errors' p50 and p90 per rate and the
bias (sum predicted / sum measured), and writes every row to OUT.

    python scripts/slo_prediction_error.py RATES REQUESTS OUT.json
    python scripts/slo_prediction_error.py 0.5,1 40 /tmp/slo_error.json
"""

import json
import os
import sys
from pathlib import Path

import httpx
import trio

from trioserve.bench.process import serving_process
from trioserve.bench.client import arrival_offsets
from trioserve.bench.datasets import load_tokenizer
from trioserve.bench.slo import DEFAULT_CLASSES, mixed_requests
from trioserve.bench.stats import percentile
from trioserve.engine.loading.sources import DEFAULT_MODEL_NAME

rates = [float(r) for r in sys.argv[1].split(",")]
n = int(sys.argv[2])
out_path = Path(sys.argv[3])
requests = mixed_requests(load_tokenizer(), DEFAULT_CLASSES, n, seed=0)

async def run(url, rate, seed):
    offsets = arrival_offsets(len(requests), rate, 1.0, seed=seed)
    rows = [None] * len(requests)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def one(i):
            r = requests[i]
            body = {"model": DEFAULT_MODEL_NAME, "prompt": r.sample.prompt, "max_tokens": r.sample.output_len,
                    "ignore_eos": True, **r.request_class.body(with_priority=True), "slo_mode": "best_effort"}
            resp = await http.post("/v1/completions", json=body)
            slo = resp.json()["usage"]["slo"]
            rows[i] = {"class": r.request_class.name, "pred": slo["predicted"]["ttft_ms"], "meas": slo["measured"]["ttft_ms"],
                       "pred_tpot": slo["predicted"]["tpot_ms"], "meas_tpot": slo["measured"]["tpot_ms"]}
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, offset in enumerate(offsets):
                await trio.sleep_until(start + offset)
                nursery.start_soon(one, i)
    return rows

out = []
with serving_process(["--max-num-seqs", "8", "--scheduling-policy", "slo"], out_path.with_suffix(".log")) as (url, _):
    trio.run(run, url, rates[0], 99)  # warm-up, at the first rate
    for rate in rates:
        load = os.getloadavg()[0]
        rows = trio.run(run, url, rate, 1)
        errors = sorted(abs(r["pred"] - r["meas"]) / r["meas"] for r in rows if r["meas"])
        terr = sorted(abs(r["pred_tpot"] - r["meas_tpot"]) / r["meas_tpot"] for r in rows if r["meas_tpot"])
        summary = {"rate": rate, "load_average": round(load, 2), "n": len(errors),
                   "ttft_rel_err_p50": round(percentile(errors, 50), 3), "ttft_rel_err_p90": round(percentile(errors, 90), 3),
                   "tpot_rel_err_p50": round(percentile(terr, 50), 3), "tpot_rel_err_p90": round(percentile(terr, 90), 3),
                   "bias": round(sum(r["pred"] for r in rows) / max(1e-9, sum(r["meas"] for r in rows)), 3)}
        print(json.dumps(summary), flush=True)
        out.append({"summary": summary, "rows": rows})
out_path.write_text(json.dumps(out, indent=1))
