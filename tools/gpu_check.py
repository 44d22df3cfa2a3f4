"""One device check, one JSON file: fingerprints, consensus, per-step guard cost, saves and restores on a GPU.

    python tools/gpu_check.py --out gpu_check.json          (tools/gpu_check.sh runs it on a lent GPU, < 8 min)
    python tools/gpu_check.py --sections guard_cost --out gpu_check.json     (issue 51's figures alone, < 3 min)
    python tools/gpu_check.py --small --out small.json      (CPU, seconds: the test suite runs it so it cannot rot)

Sections (each timed side by side on the same device, medians of repeats), in the order they run, with each one's
cap on an H100 (``CAPS``: a section past its cap is stopped there and named in ``errors``; one that would start
when the script's 470 s budget cannot hold its cap is skipped and named there too; ``seconds`` says what each took):
* ``equality`` (20 s): device fingerprints equal CPU fingerprints for 12 dtypes, odd sizes, misaligned and
  non-contiguous views, batched and per tensor; single bit flips at bits 0, 7, 22, 23, 30, 31 change them alike;
* ``guard_cost`` (150 s; ``tools/gpu_guard_cost.py``): the default guard (``GuardConfig()``) against plain steps,
  interleaved, at d=2048 and d=4096 (bf16 autocast, 24,576 and 12,288 tokens a step: device-bound), with and without
  the forward checks and ABFT; the guard's own expected overhead; the cost model's prediction for the same steps
  (``tools/bench/abft_cost_model.py``, counted on the device); ``row_stats``' GB/s against ``torch.sum``;
* ``throughput`` (40 s): one big tensor's fingerprint against ``torch.sum`` and a device copy; lanes of ~600
  tensors batched against one ``sum()`` per tensor;
* ``consensus`` (15 s): the transformer state's consensus lanes (time, and aten ops counted by a dispatch mode);
* ``step`` (60 s): plain against guarded training steps of the d=1024 transformer, interleaved (single process);
* ``owner`` (75 s): the single-owner evidence's own parts on the device, interleaved against plain steps of the
  d=256 GPT benchmark and the d=1024 transformer: the update oracle (``guard/oracle.py``; one process witnesses its
  own slices, so everything but the transfer) and the at-rest chain (``guard/chain.py``: its two passes);
* ``hf`` (60 s): Hugging Face GPT-2 and Llama, plain against guarded, weights compared bit for bit;
* ``io`` (60 s): verified save / restore / non-blocking-save blocking time against ``torch.save`` / ``torch.load`` +
  ``load_state_dict`` and ``dcp.save`` / ``dcp.load``.

The JSON is rewritten after every section, so a window that closes early leaves what ran. Exits 1 if any
fingerprint differs between devices or any section failed. Without CUDA (and without ``--small``) it says so,
exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "bench"), os.path.join(HERE, "..", "examples")]

import torch  # noqa: E402
from bench_guard import train_step  # noqa: E402
from bench_state_fingerprint import OpCount, state  # noqa: E402
from gpu_guard_cost import guard_cost  # noqa: E402

from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard, tensor_fingerprint  # noqa: E402
from verified_ckpt.fingerprint import lanes_hex  # noqa: E402
from verified_ckpt.guard.consensus import state_lanes  # noqa: E402
from verified_ckpt.lanes import batched_lanes, tensor_lanes  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
SIZES = [0, 1, 7, 1023, 1024 * 8 + 5, 300_001]
BITS = [0, 7, 22, 23, 30, 31]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def sample(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width + 8,), dtype=torch.uint8, generator=g)
    return (raw[:n] & 1).bool() if dtype == torch.bool else raw[8 : 8 + n * width].view(dtype)


def equality(device: torch.device) -> dict[str, Any]:
    cases, mismatches = [], []
    for i, dtype in enumerate(DTYPES):
        for n in SIZES:
            t = sample(dtype, n, i * 131 + n % 97)
            cases += [t, t[1:] if n > 1 else t, t[::2] if n > 2 else t]
    on_dev = [t.to(device) for t in cases]
    cpu = [str(tensor_fingerprint(t)) for t in cases]
    dev_each = [str(tensor_fingerprint(t)) for t in on_dev]
    dev_batched = [lanes_hex(x) for x in batched_lanes(on_dev).cpu().tolist()]
    mismatches = [i for i, (a, b, c) in enumerate(zip(cpu, dev_each, dev_batched, strict=True)) if not a == b == c]
    flips = []
    base = torch.randn(4097)
    for bit in BITS:
        hit = base.clone()
        hit.view(torch.int32)[1234] ^= 1 << bit
        a, b = str(tensor_fingerprint(hit)), str(tensor_fingerprint(hit.to(device)))
        flips.append({"bit": bit, "changed": a != str(tensor_fingerprint(base)), "same_on_both": a == b})
    return {"cases": len(cases), "mismatches": mismatches, "bit_flips": flips,
            "ok": not mismatches and all(f["changed"] and f["same_on_both"] for f in flips)}


def throughput(device: torch.device, big_numel: int, tensors: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    big = torch.randn(big_numel, device=device)
    nbytes = big.numel() * 4
    t_sum, t_fp = timed(big.sum, device, repeats), timed(lambda: tensor_lanes(big), device, repeats)
    t_copy = timed(big.clone, device, repeats)
    many_bytes = sum(t.nbytes for t in tensors)
    t_many = timed(lambda: batched_lanes(tensors), device, repeats)
    t_sums = timed(lambda: [t.sum() for t in tensors], device, repeats)
    return {"big_bytes": nbytes, "fingerprint_gb_s": nbytes / t_fp / 1e9, "sum_gb_s": nbytes / t_sum / 1e9,
            "fingerprint_over_sum": t_fp / t_sum, "copy_gb_s": 2 * nbytes / t_copy / 1e9,
            "many_tensors": len(tensors), "many_bytes": many_bytes, "many_fingerprint_gb_s": many_bytes / t_many / 1e9,
            "many_fingerprint_over_sums": t_many / t_sums}


def consensus(device: torch.device, tensors: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    with OpCount() as ops:
        state_lanes(tensors, device)
    return {"tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors), "aten_ops": ops.all,
            "aten_ops_not_views": ops.compute, "seconds": timed(lambda: state_lanes(tensors, device), device, repeats)}


def step_overhead(device: torch.device, d: int, layers: int, steps: int) -> dict[str, Any]:
    """Plain AdamW steps against the default per-step checks (consensus and audits off), and against the same
    without ABFT, interleaved; then where a guarded step's time goes (``profiled``)."""
    from models import TinyGPT, lm_loss

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return TinyGPT(vocab=512, d=d, layers=layers, heads=max(d // 64, 1), context=64).to(device)

    per_step: dict[str, Any] = {"audit_every": None, "consensus_every": 10**9}
    variants: dict[str, GuardConfig | None] = {"plain": None, "guarded": GuardConfig(**per_step),
                                               "guarded_no_abft": GuardConfig(abft=False, **per_step)}
    runs = {}
    for name, cfg in variants.items():
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        runs[name] = (m, opt, SDCGuard(m, opt, lm_loss, cfg) if cfg is not None else None)
    batch = torch.randint(0, 512, (8, 65), device=device)

    def one(s: int, m: torch.nn.Module, opt: torch.optim.Optimizer, guard: SDCGuard | None) -> None:
        train_step(m, opt, guard, batch, s, lm_loss)

    times: dict[str, list[float]] = {name: [] for name in runs}
    for s in range(steps):  # interleaved, so drift in clocks and caches hits both alike
        for name, run in runs.items():
            sync(device)
            t0 = time.perf_counter()
            one(s, *run)
            sync(device)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t[2:]) for name, t in times.items()}
    return {"plain_s": med["plain"], "guarded_s": med["guarded"], "overhead": med["guarded"] / med["plain"] - 1,
            "guarded_no_abft_s": med["guarded_no_abft"], "overhead_no_abft": med["guarded_no_abft"] / med["plain"] - 1,
            **profiled(lambda i: one(steps + i, *runs["guarded"]), device)}


def owner(device: torch.device, models: list[tuple[int, int, int, int]], steps: int) -> list[dict[str, Any]]:
    """Per model ``(d, layers, vocab, batch)``: a plain AdamW step, the same with the update oracle's four calls
    around it, and with the chain's two; steps interleaved, medians of per-step ratios against plain."""
    from models import TinyGPT, lm_loss
    from verified_ckpt.comm import Communicator
    from verified_ckpt.guard.chain import StateChain
    from verified_ckpt.guard.consensus import state_tensors
    from verified_ckpt.guard.oracle import UpdateOracle

    out = []
    profile = True
    for d, layers, vocab, batch in models:
        runs = {}
        for name in ("plain", "oracle", "chain"):
            torch.manual_seed(0)
            model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=max(d // 32, 1), context=64).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            params = list(model.parameters())
            runs[name] = (model, opt, UpdateOracle(opt, Communicator(), 8, device) if name == "oracle" else None,
                          StateChain(lambda ps=params, o=opt: state_tensors(ps, o), device) if name == "chain" else None)
        ids = torch.randint(0, vocab, (batch, 65), device=device)
        times: dict[str, list[float]] = {name: [] for name in runs}
        flags: list[list[float]] = []  # the oracle's (elements checked, mismatch) per step: clean, so no mismatch

        def one(s: int, model: torch.nn.Module, opt: torch.optim.Optimizer, oracle: Any, chain: Any,
                ids: torch.Tensor = ids, flags: list[list[float]] = flags) -> None:
            lm_loss(model, ids).backward()
            if oracle is not None:
                row = oracle.carry().tolist()  # the step's one gathered row: its one host sync
                oracle.agree([row])
                flags.append(row[:2])
                oracle.before_update()
            if chain is not None:
                chain.carry().tolist()
            opt.step()
            if oracle is not None:
                oracle.after_update(s)
            if chain is not None:
                chain.after_update()
            opt.zero_grad(set_to_none=True)

        for s in range(steps):
            for name, (model, opt, oracle, chain) in runs.items():
                sync(device)
                t0 = time.perf_counter()
                one(s, model, opt, oracle, chain)
                sync(device)
                times[name].append(time.perf_counter() - t0)
        ratio = {k: statistics.median(a / b for a, b in zip(times[k][3:], times["plain"][3:], strict=True)) - 1
                 for k in ("oracle", "chain")}
        checked, bad = sum(1 for c, _ in flags if c), sum(1 for _, b in flags if b)  # the timed steps

        def both(i: int, runs: dict[str, Any] = runs) -> None:
            for k in ("oracle", "chain"):
                one(steps + i, *runs[k])

        where = profiled(both, device) if profile else {}
        profile = False  # the first model's
        out.append({"d": d, "layers": layers, "vocab": vocab, "batch": batch,
                    "params": sum(p.numel() for p in runs["plain"][0].parameters()),
                    "plain_s": statistics.median(times["plain"][3:]), "oracle_overhead": ratio["oracle"],
                    "chain_overhead": ratio["chain"], "oracle_steps_checked": checked,
                    "oracle_mismatches": bad, **where})
    return out


def profiled(fn: Callable[[int], Any], device: torch.device, steps: int = 5) -> dict[str, Any]:
    """Where ``steps`` calls of ``fn`` spend their time: the host's Python (``cProfile``, by own time) and the
    aten ops (``torch.profiler``, by own host time, with their device time): for the next optimisation."""
    import cProfile
    import io as text_io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    host.enable()
    for i in range(steps):
        fn(i)
    sync(device)
    host.disable()
    buf = text_io.StringIO()
    pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(25)
    kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=kinds) as prof:
        for i in range(steps):
            fn(steps + i)
        sync(device)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    return {"profile_steps": steps, "python": buf.getvalue().splitlines()[-32:],
            "aten": [{"op": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
                      "self_device_us": getattr(e, "self_device_time_total", 0.0)} for e in ops]}


def hf(device: torch.device, kinds: list[str], d: int, steps: int) -> list[dict[str, Any]]:
    """Hugging Face GPT-2 (dropout 0.1 inside the fused attention) and Llama (grouped-query attention) at the
    library's defaults: a plain loop and the guarded one (the default per-step checks, attention's products among
    them), from the same seed: the guard must leave the weights bit for bit as the plain loop's (the fused
    attention's dropout mask is replayed for its check), raise nothing, and its cost is measured per step."""
    import transformers as tf

    def build(kind: str) -> torch.nn.Module:
        torch.manual_seed(0)
        if kind == "gpt2":
            m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1024, n_embd=d, n_layer=4, n_head=8, n_positions=65,
                                                 bos_token_id=0, eos_token_id=0))
        else:
            m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=1024, hidden_size=d, intermediate_size=4 * d,
                                                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                                   max_position_embeddings=65))
        return m.to(device)

    def loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(input_ids=b, labels=b).loss  # type: ignore[no-any-return]

    out = []
    for kind in kinds:
        batches = [torch.randint(0, 1024, (16, 65), generator=torch.Generator().manual_seed(i)).to(device)
                   for i in range(steps)]
        runs: dict[str, Any] = {}
        for name in ("plain", "guarded"):
            m = build(kind)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            runs[name] = (m, opt, SDCGuard(m, opt, loss, GuardConfig(audit_every=None, consensus_every=10**9))
                          if name == "guarded" else None)
        times: dict[str, list[float]] = {"plain": [], "guarded": []}
        incident = None
        for name, (m, opt, guard) in runs.items():  # each from the same seed, its random stream its own
            torch.manual_seed(1)
            torch.cuda.manual_seed_all(1) if device.type == "cuda" else None
            for s, b in enumerate(batches):
                sync(device)
                t0 = time.perf_counter()
                try:
                    if guard is None:
                        loss(m, b).backward()
                        opt.step()
                    else:
                        guard.backward(b, step=s)
                        guard.step()
                except Exception as e:  # an incident on a clean run is the finding
                    incident = str(e)[:300]
                    break
                opt.zero_grad()
                sync(device)
                times[name].append(time.perf_counter() - t0)
        same = all(torch.equal(a, b) for a, b in zip(runs["plain"][0].parameters(), runs["guarded"][0].parameters(),
                                                      strict=True))
        g = runs["guarded"][2]
        plain, guarded = statistics.median(times["plain"][2:]), statistics.median(times["guarded"][2:] or [0.0])
        out.append({"model": kind, "d": d, "incident": incident, "weights_equal_plain": same,
                    "abft_passed": g.checks["abft"].passed, "products": g.abft.products.names,
                    "plain_s": plain, "guarded_s": guarded, "overhead": guarded / plain - 1})
    return out


def io(device: torch.device, tensors: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.ParameterList([torch.nn.Parameter(t.to(device)) for t in tensors])
    out: dict[str, Any] = {"bytes": sum(t.nbytes for t in tensors)}
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "plain.pt")
        mgr = CheckpointManager(os.path.join(root, "run"))
        step = iter(range(10**6))
        out["torch_save_s"] = timed(lambda: torch.save(model.state_dict(), path), device, repeats)
        out["verified_save_s"] = timed(lambda: mgr.save(next(step), {"model": model}), device, repeats)
        out["dcp_save_s"] = timed(lambda: dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "dcp")),
                                  device, 1)
        t0 = time.perf_counter()  # what a non-blocking save holds the training loop for
        mgr.save(next(step), {"model": model}, blocking=False)
        out["async_blocking_s"] = time.perf_counter() - t0
        mgr.wait()
        load = lambda: model.load_state_dict(torch.load(path, map_location=device, weights_only=True))  # noqa: E731
        out["torch_load_s"] = timed(load, device, repeats)
        out["verified_restore_s"] = timed(lambda: mgr.restore({"model": model}, allow_unverified=True), device, repeats)
        out["dcp_load_s"] = timed(lambda: dcp.load({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "dcp")),
                                  device, 1)
    out["save_over_torch_save"] = out["verified_save_s"] / out["torch_save_s"]
    out["restore_over_torch_load"] = out["verified_restore_s"] / out["torch_load_s"]
    return out


# Each section's cap on an H100, in seconds (the script's budget is BUDGET_S: a section that would start past it is
# skipped, and one that runs past its cap is stopped there and recorded as such; the figures from run a on the
# H200 took about 4 minutes for every section but guard_cost).
CAPS = {"equality": 20, "guard_cost": 150, "throughput": 40, "consensus": 15, "step": 60, "owner": 75, "hf": 60,
        "io": 60}
BUDGET_S = 470.0


class SectionCap(BaseException):
    """A section ran past its cap (a BaseException: the sections' own ``except Exception`` must not swallow it)."""


def capped(name: str, cap: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, stopped by SIGALRM after ``cap`` seconds (on the main thread; between Python bytecodes, so a
    kernel running on the device finishes first)."""
    def stop(signum: int, frame: Any) -> None:
        raise SectionCap(f"section {name} ran past its cap of {cap:.0f} s")

    old = signal.signal(signal.SIGALRM, stop)
    begun = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, cap)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:  # an alarm set before this one (pytest-timeout's, in the suite) keeps what is left of its time
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - begun), 1e-3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true", help="CPU and small sizes: seconds, for the test suite")
    ap.add_argument("--sections", default="equality,guard_cost,throughput,consensus,step,owner,hf,io",
                    help="comma-separated: which sections to run (equality always runs)")
    args = ap.parse_args()
    wanted = set(args.sections.split(",")) | {"equality"}
    if not args.small and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (use --small for the CPU check)")
        return 0
    begun = time.monotonic()
    device = torch.device("cpu" if args.small else "cuda")
    # The issue-18 transformer (12 layers, d=1024, AdamW: 1.7 GiB) on a GPU; a small one for --small.
    layers, d, vocab, repeats = (2, 32, 64, 2) if args.small else (12, 1024, 8192, 5)
    # Built only for the sections that read it: a run of guard_cost alone keeps its 1.7 GiB and its seconds.
    tensors = [t.to(device) for t in state(layers, d, vocab, seq=64 if args.small else 1024)] \
        if wanted & {"throughput", "consensus", "io"} else []
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "small": args.small, "seconds": {}, "errors": {}}
    small = args.small
    sections: dict[str, Callable[[], Any]] = {
        "equality": lambda: equality(device),
        # The per-step checks at d=2048 and d=4096 (bf16, device-bound), the cost model beside them, row_stats' GB/s.
        "guard_cost": lambda: guard_cost(device, small, cap_s=0.5 * CAPS["guard_cost"]),
        "throughput": lambda: throughput(device, (1 << 16) if small else (1 << 30), tensors, repeats),
        "consensus": lambda: consensus(device, tensors, repeats),
        "step": lambda: step_overhead(device, 32 if small else 1024, 2 if small else 12, 6 if small else 40),
        # The d=256 GPT of the DDP and single-owner benchmarks (batch 16), and the d=1024 transformer above.
        "owner": lambda: owner(device, [(32, 2, 64, 4)] if small else [(256, 4, 1024, 16), (1024, 12, 8192, 8)],
                               6 if small else 40),
        "hf": lambda: hf(device, ["gpt2", "llama"], 32 if small else 256, 5 if small else 20),
        "io": lambda: io(device, tensors, repeats),
    }
    for name, fn in sections.items():
        if name not in wanted:
            continue
        t0 = time.monotonic()
        if t0 - begun + CAPS[name] > BUDGET_S:
            result["errors"][name] = f"skipped: {t0 - begun:.0f} s spent, its cap of {CAPS[name]} s would pass the " \
                                     f"script's {BUDGET_S:.0f} s (run it alone with --sections {name})"
            continue
        try:  # one section's failure is recorded, the rest still run: a lent device's minutes are few
            result[name] = capped(name, CAPS[name], fn)
        except (Exception, SectionCap) as e:
            result["errors"][name] = f"{type(e).__name__}: {str(e)[:500]}"
        result["seconds"][name] = time.monotonic() - t0
        if args.out:  # after every section, so a window that closes early still leaves what ran
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    ok = "equality" in result and result["equality"]["ok"]
    return 0 if ok and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
