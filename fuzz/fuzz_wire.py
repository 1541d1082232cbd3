"""atheris fuzz target: what the service runs on a `/prefill` body, on arbitrary bytes: the wire
decoder, the options, and the engine's prepare (validation, caps, kernel choice).

Every input must end in a zen_mla ValueError (the 4xx family) or decode and validate; any other
exception is a crash atheris reports with the input that caused it.

    .venv/bin/python fuzz/fuzz_wire.py -runs=20000          # the bounded run the tests do
    .venv/bin/python fuzz/fuzz_wire.py -max_total_time=3600 fuzz/corpus   # a long manual run
"""

from __future__ import annotations

import sys

import atheris
import torch

with atheris.instrument_imports(include=["zen_mla"]):
    from zen_mla import InvalidInputError, wire
    from zen_mla.engine import EngineConfig, PrefillEngine

# never started: prepare() needs no workers; the caps are the service's defaults
ENGINE = PrefillEngine(EngineConfig(max_work=1 << 41, max_seqs=8192))


def one_input(data: bytes) -> None:
    body = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    try:
        tensors, meta = wire.decode(body, wire.REQUEST_TENSORS)
        options = wire.parse_options(meta)
        ENGINE.prepare(tensors, options)
    except InvalidInputError:
        pass


def seeds() -> list[bytes]:
    """A valid request to start from, so mutations reach the validator."""
    q = torch.randn(6, 2, 4).bfloat16()
    header, chunks = wire.encode(
        {"q": q, "k": q, "v": q[..., :2].contiguous(), "q_cu_seq_lens": torch.tensor([0, 2, 6])},
        {"causal": "true", "scale": "0.5"},
    )
    return [header + b"".join(bytes(c) for c in chunks)]


if __name__ == "__main__":
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    for path in corpus:
        import pathlib

        folder = pathlib.Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.iterdir()):
            for i, seed in enumerate(seeds()):
                (folder / f"seed{i}").write_bytes(seed)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
