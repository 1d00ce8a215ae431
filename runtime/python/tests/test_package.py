"""The edl package against the real runtime: `edl-runtime launch` (the
binary in $EDL_RUNTIME) running small programs, and a scripted coordinator
for the edges a real one does not show on demand."""

import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from noise.connection import NoiseConnection

import edl

RUNTIME = os.environ.get("EDL_RUNTIME")
POLICY = os.environ.get("EDL_TEST_POLICY")
SECRET = "5e" * 32


def launch(tmp_path, program, *flags):
    """Runs `program` (Python source) under `edl-runtime launch`; returns (exit code, output, report)."""
    assert RUNTIME and POLICY, "run through the runtime's test suite (cargo test), which sets EDL_RUNTIME"
    src = tmp_path / "program.py"
    src.write_text(textwrap.dedent(program))
    cmd = [RUNTIME, "launch", "--policy", POLICY, "--report", "report.json",
           "--plugin-cache", str(tmp_path / "cache"), *flags, "--", sys.executable, str(src)]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "report.json").read_text()) if (tmp_path / "report.json").exists() else None
    return out.returncode, out.stdout + out.stderr, report


def logs(tmp_path):
    d = tmp_path / ".edl" / "launch" / "logs"
    return {p.name: p.read_text() for p in sorted(d.glob("worker-*.log"))}


def test_from_env_outside_a_job_says_how_to_run(monkeypatch):
    monkeypatch.delenv("EDL_COORDINATOR", raising=False)
    with pytest.raises(edl.EdlError, match="EDL_COORDINATOR is not set.*edl-runtime launch"):
        edl.Job.from_env()


def test_two_workers_split_every_step_and_keep_one_state(tmp_path):
    code, out, report = launch(tmp_path, """
        import json, os, numpy as np, edl
        job = edl.Job.from_env()
        w = np.zeros(4, dtype=np.float32)
        job.register("w", w)
        seen = []
        for step in job.steps():
            assert step.rows == len(step.indices)
            # One int64 array a step, made at its first read, writable (torch.from_numpy takes it).
            assert step.indices is step.indices and step.indices.dtype == np.int64
            assert step.indices.flags.writeable
            g = np.full(4, step.rows / step.global_rows, dtype=np.float32)
            assert step.all_reduce([g])
            assert np.allclose(g, 1.0), g          # the shares add up to the step
            w -= step.lr * g
            seen.append([step.step, step.rank, step.world, step.indices.tolist()])
            step.commit(loss=1.0)
        with open(f"seen-{job.worker_id}.json", "w") as f:
            json.dump({"steps": seen, "w": w.tolist(), "stopped": job.stopped}, f)
    """, "--samples", "100", "--batch", "10", "--epochs", "2", "--momentum", "0",
        "--workers", "2", "--min-workers", "2", "--max-workers", "2")
    assert code == 0, out
    assert [e["duplicates"] + e["missing"] for e in report["epochs"]] == [0, 0], report["epochs"]
    assert report["steps"] == 20 and report["student_test_accuracy"] is None
    runs = [json.loads((tmp_path / f"seen-{i}.json").read_text()) for i in (1, 2)]
    by_step = {}
    for r in runs:
        for step, rank, world, idx in r["steps"]:
            assert world == 2
            by_step.setdefault(step, []).append(set(idx))
    assert sorted(by_step) == list(range(20))
    for step, shares in by_step.items():
        assert len(shares) == 2 and not (shares[0] & shares[1]), (step, shares)
        assert len(shares[0] | shares[1]) == 10
    # Both ranks applied the same 20 summed updates of 1.0 each.
    for r in runs:
        assert np.allclose(r["w"], -0.05 * 20), r["w"]
        assert r["stopped"] == "the job is done"


def test_a_step_says_whether_it_was_abandoned(tmp_path):
    code, out, report = launch(tmp_path, """
        import edl, numpy as np
        job = edl.Job.from_env()
        job.register("w", np.zeros(2, dtype=np.float32))
        given_up = False
        for step in job.steps():
            assert not step.abandoned, "a step under way"
            if step.step == 3 and not given_up:
                given_up = True
                step.abandon("a collective of the program's own failed")
                assert step.abandoned
                continue
            step.commit(loss=1.0)
            assert not step.abandoned, "a committed step"
    """, "--samples", "40", "--batch", "10", "--epochs", "2",
        "--workers", "1", "--min-workers", "1", "--max-workers", "1")
    assert code == 0, out
    assert report["redone_steps"] >= 1, report["redone_steps"]


def test_a_program_that_registers_nothing_is_told_so(tmp_path):
    code, out, _ = launch(tmp_path, """
        import edl
        job = edl.Job.from_env()
        for step in job.steps():
            pass
    """, "--samples", "10", "--batch", "5", "--epochs", "1", "--max-workers", "1")
    assert code != 0
    assert "register the state" in "".join(logs(tmp_path).values()), logs(tmp_path)


class ScriptedCoordinator:
    """Welcomes one worker, then does what the test says."""

    def __init__(self, tmp_path, secret=SECRET, assign=None):
        self.secret = bytes.fromhex(secret)
        self.assign = assign
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.spec = {
            "job": "scripted", "samples": 10, "seed": 1, "epochs": 1,
            "program": {"external": {"command": ["python"]}},
            "temperature": 4.0, "alpha": 0.7, "teachers": None, "teacher_model_name": "teacher",
            "transform": None, "transform_config": [], "collective_timeout_ms": 1000,
            "checkpoint_dir": str(tmp_path / "ckpt"), "keep_checkpoints": 1, "step_delay_ms": 0,
            "device": "cpu", "plugin_deadline_ms": 100, "plugin_memory_mib": 64, "allow_native": False,
            "teacher_wait_ms": 1000,
        }
        self.conn = None
        self.hello = None
        self.claim = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.conn, _ = self.sock.accept()
        f = self.conn.makefile("rwb")
        self.file = f
        noise = self._admit(f)
        self.noise = noise
        if noise is None:
            return
        self.hello = json.loads(self._receive(f, noise))
        # It speaks the worker's control protocol, whatever its number.
        self.spec["protocol"] = self.hello["hello"].get("protocol", 0)
        if self.assign is not None:
            self._send(f, noise, (json.dumps({"assigned": {"worker": self.assign}}) + "\n").encode())
        self._send(f, noise, (json.dumps({"welcome": self.spec}) + "\n").encode())

    def _mac(self, label, parts):
        m = hmac.new(self.secret, label, hashlib.sha256)
        for p in parts:
            m.update(struct.pack("<I", len(p)) + p)
        return m.digest()

    def _admit(self, f):
        """The acceptor's side of the secret's exchange and the channel's
        Noise handshake (see host-gpu/src/comm/auth.rs), with an independent
        Noise implementation (noiseprotocol). Returns the Noise session."""
        def send(b):
            f.write(struct.pack("<I", len(b)) + b)
            f.flush()

        a = os.urandom(32)
        send(b"EDLA2" + a)
        (n,) = struct.unpack("<I", f.read(4))
        msg = f.read(n)
        c, rest = msg[:32], msg[32:]
        (offer_len,) = struct.unpack(">H", rest[:2])
        offer, rest = rest[2:2 + offer_len], rest[2 + offer_len:]
        claim, proof = rest[:-32], rest[-32:]
        if not hmac.compare_digest(proof, self._mac(b"edl connector", [a, c, claim])):
            send(b"no" + b"the peer does not know the job's secret")
            return None
        self.claim = json.loads(claim)
        noise = NoiseConnection.from_name(b"Noise_NNpsk0_25519_AESGCM_BLAKE2s")
        noise.set_psks(psk=self._mac(b"edl channel key", [a, c, claim]))
        noise.set_prologue(b"EDLA2")
        noise.set_as_responder()
        noise.start_handshake()
        noise.read_message(offer)
        reply = noise.write_message()
        assert noise.handshake_finished
        send(b"ok" + self._mac(b"edl acceptor", [c, a, claim]) + reply)
        return noise

    @staticmethod
    def _send(f, noise, plain):
        """One sealed frame: a 2-byte length and a Noise transport message."""
        sealed = noise.encrypt(plain)
        f.write(struct.pack(">H", len(sealed)) + sealed)
        f.flush()

    @staticmethod
    def _receive(f, noise):
        """One line of sealed frames."""
        line = b""
        while not line.endswith(b"\n"):
            (n,) = struct.unpack(">H", f.read(2))
            line += noise.decrypt(f.read(n))
        return line

    def close(self):
        self.thread.join(5)
        self.file.close()
        self.conn.close()
        self.sock.close()


def test_a_worker_that_does_not_know_the_secret_is_not_admitted(tmp_path):
    c = ScriptedCoordinator(tmp_path, secret="11" * 32)
    with pytest.raises(edl.EdlError, match="did not admit it to job \"scripted\": the peer does not know the job's secret"):
        edl.Job.connect(c.addr, 7, "scripted", SECRET)
    assert c.hello is None, "nothing was said before the secret was proven"
    c.close()


def test_a_worker_joining_without_an_id_has_the_one_the_coordinator_gives(tmp_path):
    c = ScriptedCoordinator(tmp_path, assign=12)
    job = edl.Job.connect(c.addr, 0, "scripted", SECRET)
    hello = c.hello["hello"]
    assert (hello["worker"], hello["pid"]) == (0, os.getpid()) and hello["protocol"] >= 1, hello
    assert job.worker_id == 12
    c.close()


def test_register_refuses_what_it_cannot_keep(tmp_path):
    c = ScriptedCoordinator(tmp_path)
    job = edl.Job.connect(c.addr, 7, "scripted", SECRET)
    assert (job.samples, job.seed, job.worker_id, job.distill) == (10, 1, 7, False)
    assert c.claim == {"job": "scripted", "channel": "control", "generation": 0, "who": 7}
    hello = c.hello["hello"]
    assert (hello["worker"], hello["pid"]) == (7, os.getpid()) and hello["protocol"] >= 1, hello
    with pytest.raises(ValueError, match="not a float32 array"):
        job.register("ints", np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="writable and C-contiguous"):
        job.register("strided", np.zeros((4, 4), dtype=np.float32)[:, 1])
    with pytest.raises(ValueError, match="job.samples: 4294967296 samples; a job holds at most 4294967295"):
        job.samples = 2**32
    job.register("w", np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="registered twice"):
        job.register("w", np.zeros(3, dtype=np.float32))
    assert job.state_layout == [("w", [2, 3])]
    c.close()


def test_a_thread_asking_the_job_while_a_step_is_awaited_does_not_hold_the_interpreter(tmp_path):
    """A read-ahead thread asks the job (its state layout) while another
    waits for the next step, holding the job: it waits without the GIL,
    which the waiting fetch needs (it checks for Ctrl-C through Python), and
    both go on once the fetch ends (here: the coordinator is gone). Run in
    a process of its own: a deadlock there is a timeout here, not a hang."""
    c = ScriptedCoordinator(tmp_path)
    script = textwrap.dedent(f"""
        import sys, threading
        import numpy as np
        import edl
        job = edl.Job.connect({c.addr!r}, 7, "scripted", {SECRET!r})
        job.register("w", np.zeros(3, dtype=np.float32))
        def fetch():
            try:
                next(iter(job.steps()))
            except edl.EdlError as e:
                print("fetch:", e, flush=True)
        t = threading.Thread(target=fetch)
        t.start()
        sys.stdin.readline()
        print("layout:", job.state_layout, flush=True)
        t.join()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        c.thread.join(60)
        # The worker said it is ready: its fetch holds the job until a generation comes.
        assert "ready" in json.loads(c._receive(c.file, c.noise))
        p.stdin.write("\n")
        p.stdin.flush()
        time.sleep(0.5)  # the main thread asks the job meanwhile
        c.close()
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err
    # The two threads print on their own: their lines may interleave.
    assert "layout: [('w', [3])]" in out and "fetch:" in out and "lost the coordinator" in out, out + err


def test_a_lost_coordinator_is_an_error_not_a_hang(tmp_path):
    c = ScriptedCoordinator(tmp_path)
    job = edl.Job.connect(c.addr, 1, "scripted", SECRET)
    job.register("w", np.zeros(3, dtype=np.float32))
    c.close()  # the coordinator is gone before any generation
    with pytest.raises(edl.EdlError, match="lost the coordinator"):
        next(iter(job.steps()))
