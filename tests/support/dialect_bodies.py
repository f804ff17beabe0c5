"""Hypothesis strategies of request bodies, one per dialect's route, built with tests/support/fuzzing.py
from each dialect's own request Structs: shared by the unit fuzz tests (decode + translate,
tests/unit/test_fuzz_dialects.py) and the HTTP ones (tests/integration/test_fuzz_http.py)."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from api.dialects import anthropic_messages as am
from api.dialects import happy_vllm as hv
from api.dialects import lmi, lmtp, tgi
from api.dialects import openai_chat as chat
from api.dialects import openai_completions as oc
from api.dialects import openai_responses as resp
from api.dialects import triton as tr
from shared.codec import encode
from shared.schemas import GenerationRequest
from tests.support.fuzzing import NUMBER_STRINGS, dict_body, encode_body, junk, raw_bodies, struct_body, texts, typed

__all__ = ["completion_bodies", "chat_bodies", "lmi_bodies", "tgi_bodies", "triton_bodies", "happy_bodies",
           "lmtp_frames", "job_bodies", "anthropic_bodies", "responses_bodies",
           "message_batch_bodies"]

# OpenAI completions (also /invocations with `prompt`)
completion_bodies = raw_bodies(struct_body(oc.CompletionRequest))

# OpenAI chat (also /invocations with `messages`)
chat_bodies = raw_bodies(struct_body(chat.ChatRequest))

# LMI: /invocations, /predictions/{model}
lmi_bodies = raw_bodies(struct_body(lmi.LmiRequest))

# TGI: /generate, /generate_stream, /
tgi_bodies = raw_bodies(struct_body(tgi.GenerateRequest))

# Triton: /v2/models/{model}/generate[_stream]
_sampling_fields = {f.encode_name: typed(f.type) for f in msgspec.inspect.type_info(hv.VllmSampling).fields}
_triton_inputs = {f.encode_name: typed(f.type) for f in msgspec.inspect.type_info(tr._Inputs).fields}
_structured_fields = {f.encode_name: typed(f.type) for f in msgspec.inspect.type_info(tr._Structured).fields}
_structured = st.one_of(dict_body(_structured_fields), dict_body(_structured_fields).map(lambda d: encode(d).decode()))
_triton_params = dict_body({**_sampling_fields, "structured_outputs": _structured, "lora_name": junk,
                            "stream": st.booleans(), "exclude_input_in_output": st.booleans()})
_sampling_json = dict_body(_sampling_fields).map(lambda d: encode(d).decode())
triton_bodies = raw_bodies(dict_body({
    **_triton_inputs, **_sampling_fields,
    "sampling_parameters": st.one_of(_sampling_json, texts, st.lists(_sampling_json, max_size=2)),
    "parameters": st.one_of(_triton_params, junk),
    "id": st.one_of(texts, junk),
    "structured_outputs": _structured,
}, required={"text_input": st.one_of(texts, st.lists(texts, max_size=2))}))

# happy_vllm: /v1/generate, /v1/generate_stream
_happy_fields = {f.encode_name: typed(f.type) for f in msgspec.inspect.type_info(hv.HappyOptions).fields}
# pydantic-style lenient values: numbers as strings, which msgspec's strict=False converts.
_lenient = {k: st.one_of(v, v.map(lambda x: x if isinstance(x, (dict, list)) else str(x)),
                         st.sampled_from(NUMBER_STRINGS))
            for k, v in _sampling_fields.items()}
_happy_optional = {k: v for k, v in _happy_fields.items() if k != "prompt"}
happy_bodies = raw_bodies(dict_body({**_happy_optional, **_lenient, "logits_processors": junk},
                                    required={"prompt": _happy_fields["prompt"]}))


# LMTP: WebSocket text frames
def _frame(verb_and_body: tuple[str, bytes]) -> str:
    return verb_and_body[0] + " " + verb_and_body[1].decode("utf-8", "replace")


lmtp_frames = st.one_of(
    *(st.tuples(st.just(verb), raw_bodies(struct_body(kind))).map(_frame)
      for verb, kind in (("GENERATE", lmtp.Generate), ("SCORE", lmtp.Score), ("MODEL_INFO", lmtp.ModelInfo))),
    st.tuples(st.sampled_from(["GENERATE", "SCORE", "FOO", ""]), junk.map(encode_body)).map(_frame),
    st.text(max_size=60),
)

# llmq's own jobs: POST /v1/jobs
job_bodies = raw_bodies(struct_body(GenerationRequest))

# Anthropic Messages: /v1/messages (count_tokens takes the same body)
anthropic_bodies = raw_bodies(struct_body(am.MessagesRequest))

# Anthropic Message Batches: /v1/messages/batches (each request's params a Messages body)
message_batch_bodies = raw_bodies(st.fixed_dictionaries({"requests": st.lists(st.fixed_dictionaries({
    "custom_id": st.one_of(st.from_regex(r"[a-zA-Z0-9_-]{1,8}", fullmatch=True), texts),
    "params": struct_body(am.MessagesRequest)}), max_size=3)}))

# OpenAI Responses: /v1/responses
responses_bodies = raw_bodies(struct_body(resp.ResponsesRequest))
