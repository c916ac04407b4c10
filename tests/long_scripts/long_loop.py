"""A training loop of fast steps for a given time, with planted anomalies (tests/test_long_run.py, bench).

    python long_loop.py SECONDS [--slow-at S] [--recompile-at S] [--fault-at-step N] [--ready FILE]

--slow-at: from S seconds on, for 30 steps, each step also sorts 2M numbers (aten::sort, ~0.1-0.2 s): slow steps.
--recompile-at: at S seconds, a torch.compile'd function (static shapes) sees a new shape once: a recompile.
--torch-profiler DIR: the loop under ``torch.profiler`` with a schedule (20 active steps every 3,025), traces in DIR.
--api-trigger-at-step: at step N, ``tpudiag.trigger(steps=3)`` (a manual window from inside the script).
--fault-at-step: from step N on, aten::tanh is wrong by 3e-3 in float32 (the float64 oracle stays exact); the
kernel is registered at the start (exact until step N).
Prints one JSON line at the end: steps done, peak and current RSS (KB) at a third of the run and at the end, current
RSS once a second, the slowest step, the steps where the planted anomalies began, the planted slow steps' time, and
the longest loop iteration after the first 5 s that was neither planted nor the recompile (a stall of the loop).
"""

import argparse
import json
import resource
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("seconds", type=float)
parser.add_argument("--slow-at", type=float)
parser.add_argument("--recompile-at", type=float)
parser.add_argument("--fault-at-step", type=int)
parser.add_argument("--ready")
parser.add_argument("--api-trigger-at-step", type=int)
parser.add_argument("--torch-profiler", metavar="DIR", help="run under torch.profiler with a schedule (the bench)")
parser.add_argument("--width", type=int, default=128)
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
layers = []
for _ in range(7):
    layers += [nn.Linear(args.width, args.width), nn.Tanh()]
model = nn.Sequential(*layers)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(32, args.width)
static = torch.compile(lambda t: t * 2 + 1, backend="eager", dynamic=False)
slow_left = 0


fault = {"on": False}


def exact_tanh(t):
    return torch.where(t.abs() > 20, t.sign(), torch.sinh(t) / torch.cosh(t))


def faulty_kernel(t):
    value = exact_tanh(t.double())
    if t.dtype == torch.float32:
        return (value * (1 + 3e-3)).float() if fault["on"] else value.float()
    return value.to(t.dtype)


if args.fault_at_step is not None:
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("tanh", faulty_kernel, "CPU")
big = torch.randn(2_000_000)


def current_rss_kb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() // 1024


prof = None
if args.torch_profiler:
    from torch.profiler import ProfilerActivity, profile, schedule

    def on_ready(p):
        p.export_chrome_trace(f"{args.torch_profiler}/trace-{p.step_num}.json")

    prof = profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        on_trace_ready=on_ready,
        schedule=schedule(wait=3000, warmup=5, active=20, repeat=0),
    )
    prof.start()
t0 = time.perf_counter()
current_third = None
step = 0
longest = 0.0
rss_third = None
rss_samples = []  # [seconds, current RSS KB] once a second
half_step = None  # the step running at half time (steps done in the second half: throughput after warm-up)
periods = []  # second half: each loop iteration's wall time (step and everything between steps)
last_now = None
next_sample = 0.0
recompiled = False
slow_from = recompile_step = api_triggered = None
planted_steps, planted_s = 0, 0.0  # the planted slow steps run, and their time (what the plain run pays too)
# The longest loop iteration (the step and what runs between steps) after the first 5 s, the planted slow steps and
# the recompile's iteration left out: a stall of the whole loop (a full garbage collection, a thread's GIL).
longest_quiet, quiet = 0.0, False
while True:
    now = time.perf_counter() - t0
    if now >= args.seconds:
        break
    if half_step is None and now >= args.seconds / 2:
        half_step = step
    if half_step is not None:
        periods.append(now - last_now)
    if quiet:
        longest_quiet = max(longest_quiet, now - last_now)
    last_now = now
    if now >= next_sample:
        rss_samples.append([round(now, 2), current_rss_kb()])
        next_sample += 1.0
    if rss_third is None and now >= args.seconds / 3:
        rss_third = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        current_third = current_rss_kb()
    if args.slow_at is not None and now >= args.slow_at:
        slow_left = 30
        slow_from = step
        args.slow_at = None
    if args.api_trigger_at_step == step:
        import tpudiag

        api_triggered = tpudiag.trigger(steps=3)
    if args.fault_at_step is not None and step == args.fault_at_step:
        fault["on"] = True
    s0 = time.perf_counter()
    opt.zero_grad()
    if slow_left:
        torch.sort(big)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    shape = (33, 4) if args.recompile_at is not None and now >= args.recompile_at and not recompiled else (32, 4)
    if shape[0] == 33:
        recompiled = True
        recompile_step = step
    static(torch.ones(shape))
    took = time.perf_counter() - s0
    longest = max(longest, took)
    quiet = now >= 5 and not slow_left and shape[0] != 33
    if slow_left:
        slow_left -= 1
        planted_steps += 1
        planted_s += took
    if prof is not None:
        prof.step()
    if step == 0 and args.ready:
        with open(args.ready, "w") as fh:
            fh.write("ready\n")
    step += 1
if prof is not None:
    prof.stop()
end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = {"steps": step, "rss_third_kb": rss_third, "rss_end_kb": end, "longest_step_s": longest}
result.update(current_third_kb=current_third, current_end_kb=current_rss_kb())
result.update(rss_samples=rss_samples, second_half_steps=step - (half_step or 0))
periods.sort()
result.update(median_period_ms=round(periods[len(periods) // 2] * 1e3, 4) if periods else None)
result.update(slow_from=slow_from, recompile_step=recompile_step, api_triggered=api_triggered)
result.update(planted_steps=planted_steps, planted_s=round(planted_s, 4), longest_quiet_s=round(longest_quiet, 4))
print(json.dumps(result))
