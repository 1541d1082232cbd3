"""A KV connector that serves a prompt's longest stored prefix: vLLM's ExampleConnector (which
stores each prompt's KV cache on disk and loads it back only for the same prompt) matched by
block-aligned prefix instead, as a prefix cache would. vLLM's CPU platform turns its own prefix
cache off for MLA (CPU_MLA); through this connector a long prompt whose prefix was seen before
is prefilled over the prefix as cached context: context chunks and the LSE merge.

    store:  generate(prompt[: L + 1])     # L a multiple of the block size: its first L tokens
    load:   generate(prompt)              # those L come from disk, the rest is prefilled

Loaded by vLLM from this file's folder (`kv_connector_module_path="_prefix_connector"`, the
folder on `sys.path`). Only new requests are handled (a benchmark runs one at a time).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)

__all__ = ["PrefixConnector"]


class PrefixConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefix: dict[str, int] = {}  # request id -> stored prefix tokens to load

    def _stored_prefix(self, token_ids: list[int]) -> int:
        """The longest block-aligned prefix of `token_ids` stored on disk, short of the last
        token (one is always computed); 0 when none is."""
        for n in range(align_to_block_size(len(token_ids), self._block_size), 0, -self._block_size):
            if os.path.exists(self._generate_foldername_debug(torch.tensor(token_ids[:n]), [])):
                return n
        return 0

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        stored = self._stored_prefix(list(request.prompt_token_ids or []))
        if stored <= num_computed_tokens:
            return 0, False
        self._prefix[request.request_id] = stored
        return stored - num_computed_tokens, False

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            token_ids = list(new.prompt_token_ids or [])
            if new.req_id in self._requests_need_load:
                stored = self._prefix.pop(new.req_id)
                # ReqMeta keeps the first align(len - 1) tokens: `stored` of stored + 1
                meta.add_request(
                    token_ids[: stored + 1], new.block_ids[0], self._block_size, False, []
                )
            elif not self._found_match_for_prompt(token_ids, []):
                meta.add_request(token_ids, new.block_ids[0], self._block_size, True, [])
        self._requests_need_load.clear()
        return meta
