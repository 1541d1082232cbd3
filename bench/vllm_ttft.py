"""Time to first token of a long prompt in vLLM's own engine: vLLM's CPU backends against zen-mla
in process and as a service, on a random DeepSeek-V2-style model of real MLA attention dims.

    .venv/bin/python bench/vllm_ttft.py [--prompts 2048,8192,16384] [--cached 16384] [--reps 3]
        [--heads 16] [--layers 2]
        [--rows default,cpu_mla,local,local_expanded,service,service_expanded,service_own]
        [--service-cpus half] [--cpu-mla-max 8192] [--question 256] [--columns fresh,cached,prefix]

Each row is an engine of its own (vLLM's `LLM`, bf16, eager, one sequence at a time) in a
process of its own under .venv-vllm's Python (made by scripts/vllm-venv when missing):

- `default`: vLLM's choice on this host (AMX_MLA where the CPU has AMX: latent attention with
  absorbed weights, which calls no prefill backend; else CPU_MLA with its own prefill, zentorch's
  on Zen).
- `cpu_mla`: CPU_MLA with vLLM's own prefill backend (ZEN_CPU on Zen with zentorch, else
  CPU_SDPA). Prompts past `--cpu-mla-max` are not run (its fp32 path takes minutes there).
- `local`: CPU_MLA, its prefill in zen-mla's kernels in the engine's process (`ZEN_MLA_URL=local`),
  cached context attended from the latent (`zen_mla/vllm/cpu_mla.py`).
- `local_expanded`: the same with `ZEN_MLA_LATENT=0`: vLLM expands the cached context with
  `kv_b_proj` and hands it to zen-mla's prefill backend.
- `service`: CPU_MLA, its prefill sent to `zen-mla serve` on the same CPUs (same-host regions),
  cached context sent as its latent (`prefill_latent`, each layer's `kv_b_proj` registered once).
- `service_expanded`: the same with `ZEN_MLA_LATENT=0`: vLLM expands the cached context and sends
  the expanded keys and values.
- `service_own`: as `service`, the service on `--service-cpus` and the engine on the others.

Columns: fresh prompts of `--prompts` tokens, and `--cached` tokens whose first half was seen
before (its KV cache loaded: vLLM's prefix cache where the engine keeps one, else
`_prefix_connector.PrefixConnector`), so the second half is prefilled over it as context: context
chunks and the LSE merge; and `--cached` tokens all cached followed by a `--question` of new
tokens (a long cached prefix and a short question); `--columns` runs some of the three. Each
prompt is random token ids, the same in
every row; each rep a new prompt. Reported: the median TTFT (`generate` of one token, the engine
in the process), and, where the prefill goes through a prefill backend, the seconds spent in its
calls ("attention") and, in process, in zen-mla's kernel; the first token of each prompt and its
logprob against the `default` row's. Writes bench/out/vllm_ttft.json and bench/out/vllm_ttft.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from _server import ROOT, start_server
from _ttft_engine import cpu_mla_is_default

ROWS = (
    "default",
    "cpu_mla",
    "local",
    "local_expanded",
    "service",
    "service_expanded",
    "service_own",
)
COLUMNS = ("fresh", "cached", "prefix")
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# one row's engine: _ttft_engine.py (.venv-vllm's Python), arguments row, model, longest, cached
ENGINE = "import sys, _ttft_engine; _ttft_engine.main(*sys.argv[1:])"


def longest_prompt(args: argparse.Namespace) -> int:
    """The most tokens a prompt of the run has: a fresh one, or a cached prefix and its
    question."""
    return max([*args.prompts, args.cached + (args.question if args.cached else 0)])


def ensure_venv() -> None:
    """.venv-vllm, made or brought up to date by scripts/vllm-venv (a moment when it is)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "vllm-venv")], check=True, cwd=ROOT)


class Row:
    """One row's engine in a process of its own on `cpus`, measuring what it is asked, one
    prompt at a time."""

    def __init__(
        self,
        row: str,
        args: argparse.Namespace,
        model: Path,
        env: dict[str, str],
        cpus: tuple[int, ...],
    ) -> None:
        self.name = row
        command = [str(VENV_PYTHON), "-c", ENGINE, row, str(model)]
        command += [str(longest_prompt(args)), str(args.cached)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")} | env
        env |= dict(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),
            OMP_WAIT_POLICY="PASSIVE",
        )
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=Path(__file__).parent,
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        self.log.seek(0)
        print(self.log.read()[-4000:], file=sys.stderr)
        raise SystemExit(f"row {self.name}: the engine's process ended ({self.proc.wait()})")

    def measure(self, column: str, tokens: int, rep: int, new: int = 0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        asked = {"column": column, "tokens": tokens, "rep": rep, "new": new}
        self.proc.stdin.write(json.dumps(asked) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def measure_interleaved(
    rows: list[Row], args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Each prompt in every row before the next prompt, the rows' order turning from one rep to
    the next, so that the host's swings (a shared VM's) fall on every row alike."""
    columns = [("fresh", n) for n in args.prompts]
    columns += [("cached", args.cached)] if args.cached else []
    columns += [("prefix", args.cached + args.question)] if args.cached and args.question else []
    columns = [(column, tokens) for column, tokens in columns if column in args.columns]
    results: dict[str, list[dict[str, Any]]] = {r.name: [] for r in rows}
    for column, tokens in columns:
        for rep in range(args.reps):
            turn = rep % len(rows)
            for row in rows[turn:] + rows[:turn]:
                if row.name == "cpu_mla" and tokens > args.cpu_mla_max:
                    continue
                new = args.question if column == "prefix" else 0
                results[row.name].append(row.measure(column, tokens, rep, new))
            done = ", ".join(
                f"{r.name} {results[r.name][-1]['ttft']:.2f}"
                for r in rows
                if results[r.name] and results[r.name][-1]["tokens"] == tokens
            )
            print(f"  {tokens} {column} rep {rep}: {done} s", file=sys.stderr, flush=True)
    return results


def _agreement(
    ms: list[dict[str, Any]], theirs: list[dict[str, Any]], column: str, tokens: int
) -> str:
    """How many first tokens equal another row's on the same prompts, and the largest logprob
    difference where they do ("" where that row did not run them)."""
    ref = {m["rep"]: m for m in theirs if (m["column"], m["tokens"]) == (column, tokens)}
    pairs = [(m, ref[m["rep"]]) for m in ms if m["rep"] in ref]
    if not pairs:
        return ""
    same = [(a, b) for a, b in pairs if a["token"] == b["token"]]
    worst = max((abs(a["logprob"] - b["logprob"]) for a, b in same), default=float("nan"))
    return f"{len(same)}/{len(pairs)}, {worst:.3f}"


def _paired_ratio(ms: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float | None:
    """The median over prompts of this row's TTFT over another row's on the same prompt (the
    two measured one after the other: a host's slow minutes fall on both)."""
    ref = {(m["column"], m["tokens"], m["rep"]): m["ttft"] for m in theirs}
    ratios = [m["ttft"] / ref[k] for m in ms if (k := (m["column"], m["tokens"], m["rep"])) in ref]
    return statistics.median(ratios) if ratios else None


def summarize(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One line per (row, column, tokens): median TTFT, attention, kernel; first tokens against
    the cpu_mla row's (the same engine but for the prefill) and the default row's."""
    lines = []
    for row, measured in results.items():
        keys = sorted(
            {(m["column"], m["tokens"]) for m in measured}, key=lambda k: (k[0] != "fresh", k[1])
        )
        for column, tokens in keys:
            ms = [m for m in measured if (m["column"], m["tokens"]) == (column, tokens)]
            against = {
                name: _agreement(ms, results.get(name, []), column, tokens)
                for name in ("cpu_mla", "default")
            }
            lines.append(
                {
                    "row": row,
                    "column": column,
                    "tokens": tokens,
                    "ttft": statistics.median(m["ttft"] for m in ms),
                    "attention": statistics.median(m["attention"] for m in ms),
                    "kernel": statistics.median(m["kernel"] for m in ms),
                    "context": statistics.median(m.get("context", 0.0) for m in ms),
                    "calls": ms[0]["calls"],
                    "vs_local": _paired_ratio(ms, results.get("local", []))
                    if row != "local"
                    else None,
                    "vs_cpu_mla": against["cpu_mla"],
                    "vs_default": against["default"],
                }
            )
    return lines


def print_tables(lines: list[dict[str, Any]]) -> None:
    columns = sorted(
        {(x["column"], x["tokens"]) for x in lines}, key=lambda k: (k[0] != "fresh", k[1])
    )
    fastest_own = {}
    for col in columns:
        own = [
            x["ttft"]
            for x in lines
            if (x["column"], x["tokens"]) == col and x["row"] in ("default", "cpu_mla")
        ]
        fastest_own[col] = min(own) if own else None
    kinds = {"fresh": "", "cached": "(half cached) ", "prefix": "(all but the question cached) "}
    header = ["row"] + [f"{t} {kinds[k]}s" for k, t in columns]
    rows = []
    for row in dict.fromkeys(x["row"] for x in lines):
        cells = [row]
        for col in columns:
            x = next(
                (x for x in lines if x["row"] == row and (x["column"], x["tokens"]) == col), None
            )
            if x is None:
                cells.append("(not run)")
                continue
            ratio = (
                f" ({x['ttft'] / fastest_own[col]:.2f}x)"
                if fastest_own[col] and row not in ("default", "cpu_mla")
                else ""
            )
            paired = f"; {x['vs_local']:.2f}x in process" if x.get("vs_local") else ""
            cells.append(f"{x['ttft']:.2f}{ratio}{paired}")
        rows.append(cells)
    print(
        "\nTTFT, median seconds (x: of vLLM's fastest own backend in the same column; in process: "
        "the median of each prompt's TTFT over the in-process row's on the same prompt)"
    )
    print(c.table(header, rows))
    print(
        "\nWhere the time goes (median seconds): attention = the prefill backend's calls; "
        "kernel = zen-mla's kernel in them; context = the cached context's part (gather, "
        "expansion or latent, attention); rest = the rest of the engine's step. First tokens "
        "against the cpu_mla row's (the same engine, vLLM's own prefill) and the default row's"
    )
    detail = [
        [
            x["row"],
            f"{x['tokens']} {x['column']}",
            f"{x['ttft']:.2f}",
            f"{x['attention']:.2f}",
            f"{x['kernel']:.2f}",
            f"{x['context']:.2f}",
            f"{x['ttft'] - x['attention']:.2f}",
            str(x["calls"]),
            x["vs_cpu_mla"],
            x["vs_default"],
        ]
        for x in lines
    ]
    print(
        c.table(
            [
                "row",
                "prompt",
                "ttft",
                "attention",
                "kernel",
                "context",
                "rest",
                "calls",
                "1st token = cpu_mla's, max |dlogprob|",
                "= default's",
            ],
            detail,
        )
    )


def plot(lines: list[dict[str, Any]], path: Path, host: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    fresh = [x for x in lines if x["column"] == "fresh"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in dict.fromkeys(x["row"] for x in fresh):
        xs = [x for x in fresh if x["row"] == row]
        ax.plot([x["tokens"] for x in xs], [x["ttft"] for x in xs], marker="o", label=row)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s")
    ax.set_title(f"vLLM TTFT, {host}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def host_name() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = [x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name")]
    return f"{names[0] if names else 'CPU'}, {len(os.sched_getaffinity(0))} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--prompts", type=ints, default=[2048, 8192, 16384])
    parser.add_argument("--cached", type=int, default=16384, help="0: no cached-prefix column")
    parser.add_argument(
        "--question",
        type=int,
        default=256,
        help="new tokens after a prefix of --cached tokens, all cached (0: no such column)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=lambda s: s.split(","), default=list(ROWS))
    parser.add_argument(
        "--columns",
        type=lambda s: s.split(","),
        default=list(COLUMNS),
        help="fresh (--prompts), cached (--cached, half of it cached), prefix (--cached cached, "
        "then --question)",
    )
    parser.add_argument("--cpu-mla-max", type=int, default=8192)
    parser.add_argument("--kernel", default="auto", help="ZEN_MLA_KERNEL of the local row")
    c.service_cpus_option(parser)
    args = parser.parse_args()
    for option, known in (("rows", ROWS), ("columns", COLUMNS)):
        unknown = set(getattr(args, option)) - set(known)
        if unknown:
            raise SystemExit(f"--{option}: unknown {sorted(unknown)}; expected among {list(known)}")
    ensure_venv()
    from _deepseek import config, write_deepseek

    host = host_name()
    everything = tuple(sorted(os.sched_getaffinity(0)))
    service_cpus = c.split_cpus(args.service_cpus or "half")
    os.sched_setaffinity(0, everything)  # this process only waits; its children are pinned
    assert service_cpus is not None
    engine_cpus = tuple(x for x in everything if x not in service_cpus)
    longest = longest_prompt(args)
    scratch = tempfile.TemporaryDirectory(prefix="zen-mla-model-")  # gone when this ends
    model = write_deepseek(
        Path(scratch.name) / "model",
        config(heads=args.heads, layers=args.layers, max_positions=2 * longest),
    )
    print(f"vLLM TTFT on {host}: {args.heads} heads, {args.layers} layers", file=sys.stderr)
    rows: list[Row] = []
    servers = []
    try:
        for row in args.rows:
            if row == "cpu_mla" and cpu_mla_is_default() and "default" in args.rows:
                continue  # the default row is CPU_MLA with its own prefill already
            env, cpus = {}, everything
            if row in ("local", "local_expanded"):
                env = {"ZEN_MLA_URL": "local", "ZEN_MLA_KERNEL": args.kernel}
            elif row.startswith("service"):
                own = row == "service_own"
                proc, url = start_server("httptools", cpus=service_cpus if own else everything)
                servers.append(proc)
                env = {"ZEN_MLA_URL": url}
                cpus = engine_cpus if own else everything
            if row.startswith(("local", "service")):
                env["ZEN_MLA_LATENT"] = "0" if row.endswith("_expanded") else "1"
            rows.append(Row(row, args, model, env, cpus))
        results = measure_interleaved(rows, args)
    finally:
        for r in rows:
            r.close()
        for proc in servers:
            proc.terminate()
            proc.wait()
    lines = summarize(results)
    print_tables(lines)
    c.OUT_DIR.mkdir(exist_ok=True)
    out = {"host": host, "heads": args.heads, "layers": args.layers, "lines": lines, "raw": results}
    (c.OUT_DIR / "vllm_ttft.json").write_text(json.dumps(out, indent=1))
    plot(lines, c.OUT_DIR / "vllm_ttft.png", host)


if __name__ == "__main__":
    main()
