"""Talks to an `edl-runtime teacher` with NVIDIA's standard OIP client
(tritonclient), unchanged, and checks its logits against NumPy.

    pip install "tritonclient[grpc,http]" numpy
    python3 examples/oip-client/check_teacher.py write /tmp/m.safetensors
    cargo run --release -p edl-runtime -- teacher --model /tmp/m.safetensors \
        --listen 127.0.0.1:18001 --http-listen 127.0.0.1:18000 &
    python3 examples/oip-client/check_teacher.py check 127.0.0.1:18001
    python3 examples/oip-client/check_teacher.py check-http 127.0.0.1:18000
"""

import json
import struct
import sys

import numpy as np

DIMS = [16, 32, 10]


def weights():
    rng = np.random.default_rng(0)
    layers = []
    for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
        layers.append((f"layers.{i}.weight", (rng.standard_normal((a, b)) * 0.3).astype("<f4")))
        layers.append((f"layers.{i}.bias", (rng.standard_normal(b) * 0.1).astype("<f4")))
    return layers


def write(path):
    """A safetensors MLP in the runtime's layout: layers.<i>.weight [in, out], layers.<i>.bias."""
    header, blobs, offset = {}, [], 0
    for name, t in weights():
        data = t.tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def check(url):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("teacher")
    meta = client.get_model_metadata("teacher")
    print("inputs", [(t.name, t.datatype, list(t.shape)) for t in meta.inputs])
    print("outputs", [(t.name, t.datatype, list(t.shape)) for t in meta.outputs])
    x = ((np.arange(4 * DIMS[0]) % 7) / 7.0).astype(np.float32).reshape(4, DIMS[0])
    tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    got = client.infer("teacher", [tensor]).as_numpy("logits")
    diff = float(np.abs(got - reference(x)).max())
    print("logits", got.shape, "max difference from NumPy", diff)
    assert diff < 1e-4

    # Triton's extensions that its tools read.
    config = client.get_model_config("teacher").config
    print("config", config.name, config.max_batch_size, [(i.name, list(i.dims)) for i in config.input])
    assert config.name == "teacher" and [i.name for i in config.input] == ["input"]
    assert list(config.input[0].dims) == [DIMS[0]] and list(config.output[0].dims) == [DIMS[-1]]
    stats = client.get_inference_statistics("teacher").model_stats[0]
    print("statistics", stats.inference_count, stats.execution_count, stats.inference_stats.success.count)
    assert stats.inference_count >= 4 and stats.inference_stats.success.count >= 1

    # What Triton refuses, refused as Triton refuses it, saying what is served.
    from tritonclient.utils import InferenceServerException

    def refused(call, status, words):
        try:
            call()
        except InferenceServerException as e:
            print("refused", e.status(), e.message())
            assert status in str(e.status()) and words in e.message(), (e.status(), e.message())
            return
        raise AssertionError(f"not refused: {words}")

    refused(lambda: client.infer("nope", [tensor]), "NOT_FOUND", "this server serves")
    refused(lambda: client.infer("teacher", [tensor], model_version="99"), "NOT_FOUND", "versions served")
    renamed = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    renamed.set_data_from_numpy(x)
    refused(lambda: client.infer("teacher", [renamed]), "INVALID_ARGUMENT", "its input is")
    asked = [grpcclient.InferRequestedOutput("probs")]
    refused(lambda: client.infer("teacher", [tensor], outputs=asked), "INVALID_ARGUMENT", "its output is")
    # Triton methods a teacher does not serve say so.
    refused(lambda: client.get_model_repository_index(), "UNIMPLEMENTED", "does not serve RepositoryIndex")
    print("ok")


def check_http(url):
    """The same over KServe v2 HTTP/REST (`teacher --http-listen`)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url=url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("teacher")
    meta = client.get_model_metadata("teacher")
    assert [i["name"] for i in meta["inputs"]] == ["input"], meta
    config = client.get_model_config("teacher")
    assert config["input"][0]["dims"] == [DIMS[0]] and config["input"][0]["data_type"] == "TYPE_FP32", config
    x = ((np.arange(4 * DIMS[0]) % 7) / 7.0).astype(np.float32).reshape(4, DIMS[0])
    want = reference(x)
    for binary in (True, False):
        tensor = httpclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        asked = [httpclient.InferRequestedOutput("logits", binary_data=binary)]
        got = client.infer("teacher", [tensor], outputs=asked).as_numpy("logits")
        diff = float(np.abs(got - want).max())
        print("http logits, binary", binary, "max difference from NumPy", diff)
        assert diff < 1e-4
    stats = client.get_inference_statistics("teacher")["model_stats"][0]
    print("http statistics", stats["inference_count"], stats["inference_stats"]["success"]["count"])
    assert stats["inference_stats"]["success"]["count"] >= 2
    try:
        client.infer("nope", [tensor])
        raise AssertionError("an unknown model was served")
    except InferenceServerException as e:
        print("refused", e.status(), e.message())
        assert "this server serves" in e.message()
    print("ok")


def reference(x):
    """The MLP's logits computed with NumPy."""
    h = x
    layers = weights()
    for i in range(0, len(layers), 2):
        h = h @ layers[i][1] + layers[i + 1][1]
        if i + 2 < len(layers):
            h = np.maximum(h, 0)
    return h


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "check-http":
        check_http(sys.argv[2])
    else:
        check(sys.argv[2])
