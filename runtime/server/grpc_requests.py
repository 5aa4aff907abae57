"""gRPC requests -> the typed GenerateRequest, so gRPC, HTTP and OpenAI share one request core.

Two services arrive here: SGLang's native `sglang.runtime.v1.SglangService` (tandem's proto,
with seed 004's fields) and the gateway's `sglang.grpc.scheduler.SglangScheduler`
(smg-grpc-proto). Only fields that are set are forwarded: proto3 `optional` fields by presence,
and, where a proto has no presence, the zero values that mean "unset" in SGLang's own servicer
(n = 0, top_p = 0, ...). Everything else is validated by `normalize_generate_request` exactly
as a `/generate` body with the same fields; `rename` maps a native field name in an error back to
the proto's.
Torch-free: this runs in the main process.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tandem.runtime.frontend.generate_request import GenerateRequest
from tandem.runtime.frontend.prompts import refuse_overlong
from tandem.runtime.frontend.limits import RequestLimits
from tandem.runtime.value_checks import ValidationError

# native SamplingParams name -> proto field, where the names differ
_GUIDED = ("json_schema", "regex", "ebnf", "choice", "structural_tag")
_NATIVE_SCALARS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty", "max_new_tokens", "min_new_tokens", "ignore_eos", "n", "seed")
_SAMPLING_FIELD = re.compile(r"sampling_params\.(\w+)(.*)")
_PROMPT_FIELD = re.compile(r"input_ids((?:\[\d+\])?)$")


@dataclass
class GrpcRequest:
    """A request: what it asks the tokenizer manager for, and how to name fields in errors."""

    generate: GenerateRequest
    renames: dict[str, str] = field(default_factory=dict)  # native sampling field -> proto path
    prompt_field: str = "input_ids"  # where the proto carries the prompt

    @property
    def native(self) -> dict[str, Any]:
        """The request as the /generate body that asks for the same (the fields it sets)."""
        return self.generate.fields()

    def rename(self, exc: ValidationError) -> ValidationError:
        m = _SAMPLING_FIELD.match(exc.field)
        if m and m.group(1) in self.renames:
            return ValidationError(self.renames[m.group(1)] + m.group(2), exc.message)
        if m := _PROMPT_FIELD.match(exc.field):
            return ValidationError(self.prompt_field + m.group(1), exc.message)
        return exc


# -- SglangService (tandem's proto) ---------------------------------------------------------------------
def native_service_request(req: Any, limits: RequestLimits, *, text: bool) -> GrpcRequest:
    """TextGenerateRequest / GenerateRequest -> a GenerateRequest."""
    if text:
        out = GrpcRequest(GenerateRequest(text=req.text), prompt_field="text")
    else:
        refuse_overlong("input_ids", len(req.input_ids), limits)  # before listing them, as the gateway's
        out = GrpcRequest(GenerateRequest(input_ids=list(req.input_ids)))
    gen = out.generate
    if req.HasField("sampling_params"):
        gen.sampling_params = _native_sampling(req.sampling_params, out.renames)
    for name in ("stream", "return_logprob", "top_logprobs_num", "logprob_start_len", "rid", "priority",
                 "require_reasoning"):
        if req.HasField(name):
            setattr(gen, name, getattr(req, name))
    if text and req.HasField("return_text_in_logprobs"):
        gen.return_text_in_logprobs = req.return_text_in_logprobs
    if req.HasField("lora_path") and req.lora_path:
        raise ValidationError("lora_path", "is not supported by this server")
    if req.HasField("session_id") and req.session_id:
        raise ValidationError("session_id", "sessions are not supported by this server")
    if req.HasField("disaggregated_params") and req.disaggregated_params.ByteSize():
        raise ValidationError("disaggregated_params", "prefill/decode disaggregation is not supported by this server")
    if req.HasField("routed_dp_rank") and req.routed_dp_rank != 0:  # as the gateway service's data_parallel_rank
        raise ValidationError("routed_dp_rank", f"this server has one rank (0), got {req.routed_dp_rank}")
    if req.HasField("max_thinking_tokens"):
        gen.sampling_params = {**(gen.sampling_params or {}), "max_thinking_tokens": req.max_thinking_tokens}
        out.renames["max_thinking_tokens"] = "max_thinking_tokens"
    return out


def _native_sampling(sp: Any, renames: dict[str, str]) -> dict[str, Any]:
    out = {name: getattr(sp, name) for name in _NATIVE_SCALARS if sp.HasField(name)}
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    legacy = [name for name in ("json_schema", "regex") if sp.HasField(name)]
    if len(legacy) > 1:
        raise ValidationError("sampling_params.regex", "cannot be combined with sampling_params.json_schema; "
                                                       "give one constraint")
    for name in legacy:
        out[name] = getattr(sp, name)
    if sp.HasField("guided_decoding"):
        kind = sp.guided_decoding.WhichOneof("constraint")
        where = "sampling_params.guided_decoding"
        if kind is None:
            raise ValidationError(where, "must set one constraint (json_schema, regex, ebnf, choice or structural_tag)")
        if legacy:
            raise ValidationError(f"{where}.{kind}", f"cannot be combined with the deprecated "
                                                     f"sampling_params.{legacy[0]}; give one constraint")
        value = getattr(sp.guided_decoding, kind)
        out[kind] = list(value.values) if kind == "choice" else value
        renames.update({k: f"{where}.{k}" for k in _GUIDED})
        if kind == "choice":
            renames["regex"] = f"{where}.choice"  # a choice is validated as the regex it becomes
    return out


# -- SglangScheduler (the gateway's proto, smg-grpc-proto) -------------------------------------------------
_SMG_CONSTRAINT = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "ebnf",
                   "structural_tag": "structural_tag"}


def scheduler_service_request(req: Any, limits: RequestLimits) -> GrpcRequest:
    """smg's GenerateRequest (token ids the gateway tokenized itself) -> a GenerateRequest.

    An explicit max_new_tokens beyond `limits.max_request_len` (the context, or the KV pool when smaller)
    is shortened to what fits, min_new_tokens with it, as SGLang's scheduler does for the
    requests its gRPC servicer hands it (its HTTP path refuses them before, as /generate here);
    a min_new_tokens above the request's own max_new_tokens is refused, as /generate does."""
    if req.HasField("mm_inputs") and req.mm_inputs.ByteSize():
        raise ValidationError("mm_inputs", "is not supported by this server (text-only model)")
    for name in ("input_embeds", "lora_id", "custom_logit_processor"):
        if getattr(req, name):
            raise ValidationError(name, "is not supported by this server")
    if req.HasField("disaggregated_params") and req.disaggregated_params.ByteSize():
        raise ValidationError("disaggregated_params", "prefill/decode disaggregation is not supported by this server")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise ValidationError("data_parallel_rank", f"this server has one rank (0), got {req.data_parallel_rank}")
    # by its length first: listing the ids of a message of tens of millions takes a second of this loop
    refuse_overlong("tokenized.input_ids", len(req.tokenized.input_ids), limits)
    input_ids = list(req.tokenized.input_ids)
    out = GrpcRequest(GenerateRequest(input_ids=input_ids, stream=req.stream), prompt_field="tokenized.input_ids")
    gen = out.generate
    if req.request_id:
        gen.rid = req.request_id
    gen.sampling_params = sp = _scheduler_sampling(req.sampling_params, out.renames)
    if (asked := sp["max_new_tokens"]) is not None:
        if sp.get("min_new_tokens", 0) > asked:  # contradicts itself: refused as on /generate, not shortened
            raise ValidationError("sampling_params.min_new_tokens",
                                  f"must be <= max_new_tokens ({asked}), got {sp['min_new_tokens']}")
        sp["max_new_tokens"] = min(asked, max(limits.max_request_len - len(input_ids), 0))
        if "min_new_tokens" in sp:
            sp["min_new_tokens"] = min(sp["min_new_tokens"], sp["max_new_tokens"])
    if req.return_logprob:
        gen.return_logprob, gen.logprob_start_len = True, req.logprob_start_len
        gen.top_logprobs_num = req.top_logprobs_num
        if req.token_ids_logprob:
            gen.token_ids_logprob = list(req.token_ids_logprob)
    if req.return_hidden_states:
        gen.return_hidden_states = True
    if req.require_reasoning:
        gen.require_reasoning = True
    return out


def _scheduler_sampling(sp: Any, renames: dict[str, str]) -> dict[str, Any]:
    """No presence on most fields: the values SGLang's servicer treats as "unset" are left out."""
    out: dict[str, Any] = {"temperature": sp.temperature, "min_p": sp.min_p,
                           "frequency_penalty": sp.frequency_penalty, "presence_penalty": sp.presence_penalty}
    for name in ("top_p", "repetition_penalty", "n", "min_new_tokens"):
        if getattr(sp, name):
            out[name] = getattr(sp, name)
    if sp.top_k:  # 0 is proto's unset; SGLang's "no top-k" is -1
        out["top_k"] = sp.top_k
    # unset max_new_tokens is null, which fills the context, as SGLang's servicer passes None
    out["max_new_tokens"] = sp.max_new_tokens if sp.HasField("max_new_tokens") else None
    if sp.HasField("stream_interval"):
        out["stream_interval"] = sp.stream_interval
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "ignore_eos", "no_stop_trim"):
        out[name] = getattr(sp, name)
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        out["logit_bias"] = dict(sp.logit_bias)
    if sp.HasField("custom_params") and sp.custom_params.fields:
        raise ValidationError("sampling_params.custom_params", "is not supported by this server")
    kind = sp.WhichOneof("constraint")
    if kind is not None:
        out[_SMG_CONSTRAINT[kind]] = getattr(sp, kind)
        renames["ebnf"] = "sampling_params.ebnf_grammar"
    return out
