"""Codec: round trips of every message, pinned wire bytes, raw array payloads, bad input."""
from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from tandem.ipc import messages as m
from tandem.ipc.codec import (
    ARRAY_EXT_CODE,
    WireError,
    decode,
    decode_array,
    encode,
    encode_array,
)
from tandem.runtime.sampling.params import SamplingParams


def _i32(*vals: int) -> np.ndarray:
    return np.array(vals, dtype="<i4")


def _batch_columns() -> dict[str, Any]:
    """Two requests: the first with every logprob payload, the second with none."""
    top_val = np.array([[-0.5, -1.5], [-0.25, -2.0]], dtype="<f4")
    top_idx = np.array([[7, 8], [9, 10]], dtype="<i4")
    return dict(
        rids=["r0", "r1"],
        finished_reasons=[
            None,
            m.FinishReason(type="abort", message="too long", status_code=400),
        ],
        new_token_ids=[_i32(5, 6), _i32()],
        counters=[m.ReqCounters(completion_tokens=2, cached_tokens=1, retractions=1, reasoning_tokens=2,
                                spec=m.SpecCounts(verify_ct=3, proposed=9, accepted=4, accept_histogram=[1, 0, 2])),
                  m.ReqCounters(completion_tokens=0, cached_tokens=0)],
        output_logprobs=[
            m.LogprobArrays(token_logprobs=np.array([-0.5, -0.25], dtype="<f4"), token_ids=_i32(5, 6),
                            top_vals=top_val, top_idx=top_idx, ids_logprobs=top_val[:, :1].copy()),
            None,
        ],
        input_logprobs=[
            m.LogprobArrays(token_logprobs=np.array([np.nan, -3.0, -1.0], dtype="<f4"), token_ids=_i32(1, 2, 3),
                            top_vals=np.zeros((3, 2), dtype="<f4"), top_idx=np.ones((3, 2), dtype="<i4"),
                            ids_logprobs=np.zeros((3, 0), dtype="<f4"), null_prefix=1),
            None,
        ],
        hidden_states=[np.arange(4, dtype="<f4").reshape(2, 2), None],
    )


def sample_messages() -> dict[str, m.Message]:
    """One fixed instance of every message type, keyed by tag."""
    sp = SamplingParams(max_new_tokens=16, temperature=0.5, stop=["</s>"], stop_token_ids=[2])
    msgs: list[m.Message] = [
        m.TokenizedGenerateReq(
            rid="req-1",
            input_ids=_i32(1, 2, 3, 4),
            sampling_params=sp,
            stream=True,
            logprob=m.LogprobParams(return_logprob=True, logprob_start_len=1, top_logprobs_num=2,
                                    token_ids_logprob=(7,)),
            return_hidden_states=True,
            priority=3,
            extra_key="lora-a",
        ),
        m.AbortReq(group_prefixes=["0123456789abcdef_", "fedcba9876543210_"]),
        m.BatchTokenIDOutput(detokenize_params=[m.DetokenizeParams(stop_strings=("\n\n",)), None],
                             **_batch_columns()),
        m.BatchStrOutput(texts=["hello", ""], **_batch_columns()),
        m.FlushCacheReq(req_id=7),
        m.FlushCacheReply(req_id=7, success=False, message="requests are running"),
        m.GetServerInfoReq(req_id=8),
        m.GetServerInfoReply(req_id=8, info={"num_running_reqs": 2, "token_usage": 0.5, "ok": True}),
        m.WeightsReq(req_id=9, op="update_from_distributed", names=["w"], dtypes=["bfloat16"], shapes=[[2, 3]],
                     tensors=b"\x00safetensors"),
        m.ControlReply(req_id=9, success=True, message="1 weights updated", values=[[0.5, -1.0]]),
        m.PauseReq(req_id=10, mode="retract"),
        m.ReadyMsg(
            role="scheduler",
            pid=4242,
            max_total_tokens=8192,
            context_len=2048,
            vocab_size=32000,
            max_running_requests=64,
        ),
        m.ChildError(role="detokenizer", message="tokenizer not found"),
    ]
    return {type(x).__name__: x for x in msgs}


def assert_same(a: Any, b: Any, path: str = "$") -> None:
    """Deep equality that compares arrays by dtype, shape and content (NaN-aware)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b), path
        for f in a.__struct_fields__:
            assert_same(getattr(a, f), getattr(b, f), f"{path}.{f}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b and type(a) is type(b), (path, a, b)


def test_samples_cover_every_message_type() -> None:
    assert set(sample_messages()) == {t.__name__ for t in m.MESSAGE_TYPES}


@pytest.mark.parametrize("tag", sorted(sample_messages()))
def test_round_trip(tag: str) -> None:
    msg = sample_messages()[tag]
    out = decode(encode(msg))
    assert type(out) is type(msg)
    assert_same(msg, out)


def test_round_trip_keeps_2d_shapes_dtypes_and_nones() -> None:
    out = decode(encode(sample_messages()["BatchTokenIDOutput"]))
    assert out.output_logprobs[0].top_vals.shape == (2, 2)
    assert out.output_logprobs[0].top_vals.dtype == np.dtype("<f4")
    assert out.output_logprobs[0].top_idx.dtype == np.dtype("<i4")
    assert out.input_logprobs[0].ids_logprobs.shape == (3, 0)
    assert out.input_logprobs[0].null_prefix == 1
    assert out.output_logprobs[1] is None and out.hidden_states[1] is None
    assert out.hidden_states[0].shape == (2, 2)
    assert out.finished_reasons[0] is None
    assert np.isnan(out.input_logprobs[0].token_logprobs[0])


def test_array_payload_is_raw_little_endian_bytes() -> None:
    raw = np.arange(4, dtype="<i4").tobytes()
    msg = m.TokenizedGenerateReq(
        rid="x",
        input_ids=np.arange(4, dtype="<i4"),
        sampling_params=SamplingParams(),
        stream=False,
    )
    buf = encode(msg)
    assert raw in buf
    assert b"pickle" not in buf and b"\x80\x04" not in buf  # no pickle protocol header


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian input goes out little-endian
        np.arange(12, dtype="<i8").reshape(3, 4)[:, ::2],  # non-contiguous
        np.array(3.5, dtype="<f8"),  # 0-d
        np.array([True, False]),
        np.arange(3, dtype=np.float16),
        np.zeros((0, 5), dtype="<f4"),
    ],
)
def test_array_ext_round_trip(arr: np.ndarray) -> None:
    ext = encode_array(arr)
    assert ext.code == ARRAY_EXT_CODE
    assert bytes(ext.data[1:2]) in (b"<", b"|")  # the dtype on the wire names its byte order
    out = decode_array(ext.data)
    assert out.dtype == arr.dtype.newbyteorder("<")
    assert out.dtype.str[0] in "<|"  # explicit little-endian (or byte-sized)
    np.testing.assert_array_equal(out, arr)


def _payload_at(payload: bytes, offset: int) -> tuple[np.ndarray, memoryview]:
    """``payload`` placed ``offset`` bytes into a fresh (16-byte aligned) numpy buffer."""
    store = np.zeros(len(payload) + 32, dtype=np.uint8)
    store[offset : offset + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    return store, memoryview(store)[offset : offset + len(payload)]


def test_decoded_array_is_a_view_when_aligned() -> None:
    arr = np.arange(100, dtype="<i8")
    payload = encode_array(arr).data
    header = len(payload) - arr.nbytes  # 13 bytes for a 1-D array
    store, view = _payload_at(payload, 16 - header)  # data lands on a 16-byte boundary
    out = decode_array(view)
    assert np.shares_memory(out, store)
    np.testing.assert_array_equal(out, arr)


def test_unaligned_array_is_copied_once() -> None:
    arr = np.arange(100, dtype="<i8")
    payload = encode_array(arr).data
    header = len(payload) - arr.nbytes
    store, view = _payload_at(payload, 17 - header)
    out = decode_array(view)
    assert out.flags.aligned and not np.shares_memory(out, store)
    np.testing.assert_array_equal(out, arr)


def test_object_arrays_are_refused() -> None:
    with pytest.raises(TypeError):
        encode(m.AbortReq(group_prefixes=np.array(["a"], dtype=object)))  # type: ignore[arg-type]


def test_numpy_scalars_encode_as_plain_numbers() -> None:
    msg = m.ReadyMsg(role="scheduler", pid=np.int64(7), vocab_size=np.int32(9))  # type: ignore
    out = decode(encode(msg))
    assert out.pid == 7 and type(out.pid) is int


@pytest.mark.parametrize(
    "buf",
    [
        b"",
        b"garbage",
        b"\x81\xa4type\xa3Foo",  # unknown tag
        b"\x82\xa4type\xa8AbortReq\xaegroup_prefixes\x07",  # wrong field type
    ],
)
def test_garbage_raises_wire_error(buf: bytes) -> None:
    with pytest.raises(WireError, match="invalid tandem message"):
        decode(buf)


def test_truncated_message_raises_wire_error() -> None:
    buf = encode(sample_messages()["TokenizedGenerateReq"])
    with pytest.raises(msgspec.DecodeError, match="invalid tandem message"):
        decode(buf[:-5])


def test_list_where_array_expected_is_rejected() -> None:
    buf = msgspec.msgpack.encode(
        {"type": "TokenizedGenerateReq", "rid": "a", "input_ids": [1, 2],
         "sampling_params": {}, "stream": False}
    )
    with pytest.raises(WireError, match="input_ids"):
        decode(buf)


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\x03>i4\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01", "little-endian"),
        (b"\x03|O8\x00" + bytes(8), "little-endian numeric"),
        (b"\x03<i8\x01\x02\x00\x00\x00\x00\x00\x00\x00" + bytes(8), "needs 16"),
        (b"\x03<i4\x02\x01", "truncated"),
        (b"", "empty"),
    ],
)
def test_bad_array_payloads(payload: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_array(payload)
    ext = msgspec.msgpack.Ext(ARRAY_EXT_CODE, payload)
    bad = msgspec.msgpack.encode({"type": "GetServerInfoReply", "info": {"x": ext}})
    with pytest.raises(WireError, match="invalid tandem message"):
        decode(bad)


def test_unknown_ext_code() -> None:
    bad = msgspec.msgpack.encode(
        {"type": "GetServerInfoReply", "info": {"x": msgspec.msgpack.Ext(9, b"")}}
    )
    with pytest.raises(WireError, match="ext code 9"):
        decode(bad)


# Wire bytes pinned per message type (hex of encode(sample_messages()[tag])). A failure here
# means the wire format changed: fine if intended (regenerate), a bug otherwise.
GOLDEN_HEX: dict[str, str] = {
    "WeightsReq": (
        "de0007a474797065aa57656967687473526571a67265715f696409a26f70b77570646174655f66726f6d5f64"
        "69737472696275746564a774656e736f7273c40c007361666574656e736f7273a56e616d657391a177a66474"
        "7970657391a862666c6f61743136a673686170657391920203"
    ),
    "ControlReply": (
        "85a474797065ac436f6e74726f6c5265706c79a67265715f696409a773756363657373c3a76d657373616765"
        "b13120776569676874732075706461746564a676616c7565739192cb3fe0000000000000cbbff0000000000000"
    ),
    "PauseReq": "83a474797065a85061757365526571a67265715f69640aa46d6f6465a772657472616374",
    "AbortReq": (
        "82a474797065a841626f7274526571ae67726f75705f707265666978657392b13031323334353637"
        "38396162636465665fb1666564636261393837363534333231305f"
    ),
    "BatchStrOutput": (
        "89a474797065ae42617463685374724f7574707574a47269647392a27230a27231b066696e697368"
        "65645f726561736f6e7392c083a474797065a561626f7274a76d657373616765a8746f6f206c6f6e"
        "67ab7374617475735f636f6465cd0190ad6e65775f746f6b656e5f69647392c71501033c69340102"
        "000000000000000500000006000000c70d01033c6934010000000000000000a8636f756e74657273"
        "92950201010294030904930100029500000000c0af6f75747075745f6c6f6770726f62739296c715"
        "01033c6634010200000000000000000000bf000080bec71501033c69340102000000000000000500"
        "000006000000c72501033c66340202000000000000000200000000000000000000bf0000c0bf0000"
        "80be000000c0c72501033c6934020200000000000000020000000000000007000000080000000900"
        "00000a000000c71d01033c66340202000000000000000100000000000000000000bf000080be00c0"
        "ae696e7075745f6c6f6770726f62739296c71901033c66340103000000000000000000c07f000040"
        "c0000080bfc71901033c6934010300000000000000010000000200000003000000c72d01033c6634"
        "02030000000000000002000000000000000000000000000000000000000000000000000000000000"
        "00c72d01033c69340203000000000000000200000000000000010000000100000001000000010000"
        "000100000001000000c71501033c6634020300000000000000000000000000000001c0ad68696464"
        "656e5f73746174657392c72501033c66340202000000000000000200000000000000000000000000"
        "803f0000004000004040c0a5746578747392a568656c6c6fa0"
    ),
    "BatchTokenIDOutput": (
        "89a474797065b24261746368546f6b656e49444f7574707574a47269647392a27230a27231b06669"
        "6e69736865645f726561736f6e7392c083a474797065a561626f7274a76d657373616765a8746f6f"
        "206c6f6e67ab7374617475735f636f6465cd0190ad6e65775f746f6b656e5f69647392c71501033c"
        "69340102000000000000000500000006000000c70d01033c6934010000000000000000a8636f756e"
        "7465727392950201010294030904930100029500000000c0af6f75747075745f6c6f6770726f6273"
        "9296c71501033c6634010200000000000000000000bf000080bec71501033c693401020000000000"
        "00000500000006000000c72501033c66340202000000000000000200000000000000000000bf0000"
        "c0bf000080be000000c0c72501033c69340202000000000000000200000000000000070000000800"
        "0000090000000a000000c71d01033c66340202000000000000000100000000000000000000bf0000"
        "80be00c0ae696e7075745f6c6f6770726f62739296c71901033c66340103000000000000000000c0"
        "7f000040c0000080bfc71901033c6934010300000000000000010000000200000003000000c72d01"
        "033c6634020300000000000000020000000000000000000000000000000000000000000000000000"
        "0000000000c72d01033c693402030000000000000002000000000000000100000001000000010000"
        "00010000000100000001000000c71501033c6634020300000000000000000000000000000001c0ad"
        "68696464656e5f73746174657392c72501033c663402020000000000000002000000000000000000"
        "00000000803f0000004000004040c0b16465746f6b656e697a655f706172616d739295c3c3c291a2"
        "0a0a90c0"
    ),
    "ChildError": (
        "83a474797065aa4368696c644572726f72a4726f6c65ab6465746f6b656e697a6572a76d65737361"
        "6765b3746f6b656e697a6572206e6f7420666f756e64"
    ),
    "FlushCacheReply": (
        "84a474797065af466c75736843616368655265706c79a67265715f696407a773756363657373c2a7"
        "6d657373616765b47265717565737473206172652072756e6e696e67"
    ),
    "FlushCacheReq": (
        "82a474797065ad466c7573684361636865526571a67265715f696407"
    ),
    "GetServerInfoReply": (
        "83a474797065b2476574536572766572496e666f5265706c79a67265715f696408a4696e666f83b0"
        "6e756d5f72756e6e696e675f7265717302ab746f6b656e5f7573616765cb3fe0000000000000a26f"
        "6bc3"
    ),
    "GetServerInfoReq": (
        "82a474797065b0476574536572766572496e666f526571a67265715f696408"
    ),
    "ReadyMsg": (
        "87a474797065a852656164794d7367a4726f6c65a97363686564756c6572a3706964cd1092b06d61"
        "785f746f74616c5f746f6b656e73cd2000ab636f6e746578745f6c656ecd0800aa766f6361625f73"
        "697a65cd7d00b46d61785f72756e6e696e675f726571756573747340"
    ),
    "TokenizedGenerateReq": (
        "89a474797065b4546f6b656e697a656447656e6572617465526571a3726964a57265712d31a9696e"
        "7075745f696473c71d01033c693401040000000000000001000000020000000300000004000000af"
        "73616d706c696e675f706172616d73de0019ae6d61785f6e65775f746f6b656e7310ae6d696e5f6e"
        "65775f746f6b656e7300ab74656d7065726174757265cb3fe0000000000000a5746f705f70cb3ff0"
        "000000000000a5746f705f6bffa56d696e5f70cb0000000000000000b16672657175656e63795f70"
        "656e616c7479cb0000000000000000b070726573656e63655f70656e616c7479cb00000000000000"
        "00b272657065746974696f6e5f70656e616c7479cb3ff0000000000000a473746f7091a43c2f733e"
        "aa73746f705f726567657890ae73746f705f746f6b656e5f6964739102aa69676e6f72655f656f73"
        "c2b3736b69705f7370656369616c5f746f6b656e73c3bd7370616365735f6265747765656e5f7370"
        "656369616c5f746f6b656e73c3ac6e6f5f73746f705f7472696dc2aa6c6f6769745f62696173c0a1"
        "6e01ad73616d706c696e675f73656564c0af73747265616d5f696e74657276616cc0b36d61785f74"
        "68696e6b696e675f746f6b656e73c0ab6a736f6e5f736368656d61c0a57265676578c0a465626e66"
        "c0ae7374727563747572616c5f746167c0a673747265616dc3a76c6f6770726f6284ae7265747572"
        "6e5f6c6f6770726f62c3b16c6f6770726f625f73746172745f6c656e01b0746f705f6c6f6770726f"
        "62735f6e756d02b1746f6b656e5f6964735f6c6f6770726f629107b472657475726e5f6869646465"
        "6e5f737461746573c3a87072696f7269747903a965787472615f6b6579a66c6f72612d61"
    ),
}


@pytest.mark.parametrize("tag", sorted(sample_messages()))
def test_golden_wire_bytes(tag: str) -> None:
    assert encode(sample_messages()[tag]).hex() == GOLDEN_HEX[tag]
