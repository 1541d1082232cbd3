"""The `/v2` infer over gRPC as one more caller of tests/service/many_clients.py (`grpc_caller`,
tritonclient.grpc, one client per thread): raw tensor contents, each answer the library's own."""

from __future__ import annotations

import time

import torch
from tritonclient.grpc import InferenceServerClient, InferenceServerException, InferInput
from tritonclient.utils import np_to_triton_dtype

import zen_mla
from tests.service.many_clients import Case, Plan, Tally, _loop_cases, _record, _retried
from tests.service.servers import Server
from tests.service.v2_tensors import to_numpy, to_torch
from zen_mla.errors import (
    DeadlineExceededError,
    QueueFullError,
    ServiceUnavailableError,
    ZenMLAError,
)

#: the errors a caller raises for a gRPC status (a QueueFullError is retried)
RAISED = {
    "StatusCode.RESOURCE_EXHAUSTED": QueueFullError,
    "StatusCode.DEADLINE_EXCEEDED": DeadlineExceededError,
    "StatusCode.UNAVAILABLE": ServiceUnavailableError,
}


def grpc_inputs(tensors: dict[str, torch.Tensor]) -> list[InferInput]:
    inputs = []
    for n, t in tensors.items():
        a = to_numpy(t)
        i = InferInput(n, list(a.shape), np_to_triton_dtype(a.dtype))
        i.set_data_from_numpy(a)
        inputs.append(i)
    return inputs


def grpc_caller(server: Server, cases: list[Case], start: int, plan: Plan, tally: Tally) -> None:
    name = f"grpc_{start}"

    def one(client: InferenceServerClient, case: Case) -> tuple[torch.Tensor, ...]:
        inputs = grpc_inputs(case.tensors)
        params = {"causal": case.causal, "return_lse": case.return_lse}

        def infer() -> tuple[torch.Tensor, ...]:
            try:
                result = client.infer(
                    "mla_prefill", inputs, parameters=params, client_timeout=plan.timeout
                )
            except InferenceServerException as exc:
                message = f"grpc {exc.status()}: {exc.message()}"
                if exc.status() == "StatusCode.INVALID_ARGUMENT":
                    raise zen_mla.InvalidInputError("request", "one it accepts", message) from exc
                raised = RAISED.get(str(exc.status()), ZenMLAError)(message)
                if isinstance(raised, QueueFullError):
                    raised.retry_after = 1.0
                raise raised from exc
            out, lse = result.as_numpy("out"), result.as_numpy("lse")
            got = (to_torch(out),)
            return got + ((to_torch(lse),) if lse is not None else ())

        return _retried(infer, time.monotonic() + plan.timeout)

    with InferenceServerClient(server.grpc_target) as client:
        for case in _loop_cases(cases, start, plan):
            _record(tally, "grpc", name, case, lambda case=case: one(client, case))
