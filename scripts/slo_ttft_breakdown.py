"""Where the latency model's TTFT error comes from (docs/reliability.md,
"How good the predictions are"): bench/slo.py's mix at each rate, in
process on an engine like `trioserve serve --scheduling-policy slo
--max-num-seqs 8` (the default model), each request in best effort, and
per request its measured TTFT split at the start of the step that first
computes its prompt (``before``: the load ahead and the step in flight at
its arrival; ``own``: its prompt's step, shared with the others' tokens)
against the parts the prediction simulated
(``LatencyModel.predict_ttft_parts``). Prints a table per rate and class
and writes every row, and every step the engine ran, to OUT.

    python scripts/slo_ttft_breakdown.py RATES REQUESTS OUT.json
    python scripts/slo_ttft_breakdown.py 1,10,20 90 /tmp/slo_breakdown.json
"""

import bisect
import json
import math
import os
import sys
import time
from pathlib import Path

import attrs
import trio

from trioserve.actors import open_engine
from trioserve.actors import handle, slo_admission
from trioserve.bench.client import arrival_offsets
from trioserve.bench.datasets import load_tokenizer
from trioserve.bench.slo import DEFAULT_CLASSES, mixed_requests
from trioserve.bench.stats import percentile
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.latency_model import LatencyModel
from trioserve.engine.latency_objectives import LatencyObjectives
from trioserve.engine.sampling.sampling_params import SamplingParams


def main(rates, n, out_path):
    requests = mixed_requests(load_tokenizer(), DEFAULT_CLASSES, n, seed=0)
    steps = []  # (end, seconds, predicted seconds before learning it, shape)
    parts = {}  # request id -> the simulated parts of each prediction made for it

    observe = LatencyModel.observe

    def logged_observe(self, shape, seconds):
        steps.append((time.monotonic(), seconds, self.step_seconds(shape), shape))
        observe(self, shape, seconds)

    LatencyModel.observe = logged_observe
    predict = slo_admission.predict

    def logged_predict(model, new, ahead, running, **kwargs):
        prediction = predict(model, new, ahead, running, **kwargs)
        step_left = kwargs.get("step_left", 0.0)
        simulated = model.predict_ttft_parts(
            new.num_tokens, cached_tokens=kwargs.get("cached_tokens", 0), ahead=ahead, running=running,
            behind=kwargs.get("behind", ())[: max(0, kwargs["max_num_seqs"] - len(running) - len(ahead) - new.params.n)],
            arrivals=kwargs.get("arrivals", ()), arrivals_for=kwargs.get("arrivals_for", math.inf),
            token_budget=kwargs["token_budget"],
            max_num_seqs=kwargs["max_num_seqs"],
        )  # fmt: skip
        parts.setdefault(new.request_id, []).append(
            (prediction.ttft, step_left + simulated.before, simulated.own, len(ahead), len(running), step_left)
        )
        return prediction

    slo_admission.predict = logged_predict
    predict_on = handle.predict_on
    chosen = {}  # request id -> (its prediction's TTFT, running requests it assumed preempted)

    def logged_predict_on(scheduler, model, new, now, *args, **kwargs):
        prediction = predict_on(scheduler, model, new, now, *args, **kwargs)
        chosen[new.request_id] = (prediction.ttft, prediction.preempts)
        return prediction

    handle.predict_on = logged_predict_on

    async def run_rate(engine, rate, seed, tag):
        offsets = arrival_offsets(len(requests), rate, 1.0, seed=seed)
        times = {}

        async def one(i):
            r = requests[i]
            c = r.request_class
            objectives = LatencyObjectives(ttft=c.ttft_ms / 1000, tpot=c.tpot_ms / 1000, best_effort=True)
            params = SamplingParams(max_tokens=r.sample.output_len, ignore_eos=True)
            rid = f"{tag}-{i}"
            async for output in engine.generate(
                r.sample.prompt, params, priority=c.priority, objectives=objectives, request_id=rid
            ):
                if output.finish_reason is not None:
                    times[i] = output.times

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, offset in enumerate(offsets):
                await trio.sleep_until(start + offset)
                nursery.start_soon(one, i)
        return times

    async def run():
        out = []
        async with open_engine(EngineConfig(max_num_seqs=8, scheduling_policy="slo")) as engine:
            await run_rate(engine, rates[0], 99, "warm")
            for rate in rates:
                load = os.getloadavg()[0]
                first_step = len(steps)
                times = await run_rate(engine, rate, 1, f"r{rate}")
                rows = analyse(rate, times, steps[first_step:])
                # The steps too (end, seconds, predicted, shape): a request's
                # wait read step by step found the door's misreadings of
                # the step in flight (acb46c0).
                log = [(end, sec, pred, attrs.asdict(shape)) for end, sec, pred, shape in steps[first_step:]]
                out.append({"rate": rate, "load_average": round(load, 2), "rows": rows, "steps": log})
                report(rate, load, rows)
                out_path.write_text(json.dumps(out, indent=1))
        return out

    def analyse(rate, times, log):
        ends = [end for end, *_ in log]
        starts = {}
        rows = []
        for i, t in times.items():
            if t.first_token is None:
                continue
            # The step that gave its first token (its end is logged just after the token).
            k = min(bisect.bisect_left(ends, t.first_token), len(log) - 1)
            end, seconds, step_predicted, shape = log[k]
            start = end - seconds
            starts[i] = start
            # The step in flight at its arrival: the part of it still to run.
            j = bisect.bisect_right(ends, t.arrival)
            in_flight = 0.0  # none when it arrived between steps
            if j < len(log) and ends[j] - log[j][1] <= t.arrival:
                in_flight = ends[j] - t.arrival
            predicted, preempts = chosen[f"r{rate}-{i}"]
            _, before, own, ahead, running, step_left = next(p for p in parts[f"r{rate}-{i}"] if p[0] == predicted)
            rows.append({
                "i": i, "class": requests[i].request_class.name, "arrival": t.arrival,
                "measured": t.first_token - t.arrival, "predicted": predicted,
                "measured_before": max(0.0, start - t.arrival), "predicted_before": before,
                "measured_own": t.first_token - start, "predicted_own": own,
                "own_step_law": step_predicted, "own_step_prefill": shape.prefill_tokens,
                "own_step_decodes": shape.decodes, "in_flight": in_flight, "predicted_in_flight": step_left,
                "ahead": ahead, "running": running, "preempts": preempts,
            })  # fmt: skip
        for row in rows:
            # Requests that arrived after it and whose prompt ran first: unseen at its door.
            row["passed_by"] = sum(
                1 for other in rows if other["arrival"] > row["arrival"] and starts[other["i"]] < starts[row["i"]]
            )
        return rows

    def report(rate, load, rows):
        print(f"rate {rate} req/s, load average {load:.1f}")
        print("class n | TTFT meas pred | before meas pred | in-flight meas pred | own meas pred law | passed-by (share) | preempting | err p50 p90")
        for name in ("interactive", "batch", None):
            sel = [r for r in rows if name is None or r["class"] == name]
            if not sel:
                continue

            def mean(key):
                return sum(r[key] for r in sel) / len(sel)

            errors = sorted(abs(r["predicted"] - r["measured"]) / r["measured"] for r in sel)
            passed = sum(1 for r in sel if r["passed_by"]) / len(sel)
            print(
                f"{name or 'all'} {len(sel)} | {mean('measured')*1000:.0f} {mean('predicted')*1000:.0f} | "
                f"{mean('measured_before')*1000:.0f} {mean('predicted_before')*1000:.0f} | {mean('in_flight')*1000:.0f} {mean('predicted_in_flight')*1000:.0f} | "
                f"{mean('measured_own')*1000:.0f} {mean('predicted_own')*1000:.0f} {mean('own_step_law')*1000:.0f} | "
                f"{mean('passed_by'):.1f} ({passed:.2f}) | {sum(1 for r in sel if r['preempts'])} | {percentile(errors, 50):.2f} {percentile(errors, 90):.2f}",
                flush=True,
            )

    trio.run(run)


if __name__ == "__main__":
    main([float(r) for r in sys.argv[1].split(",")], int(sys.argv[2]), Path(sys.argv[3]))
