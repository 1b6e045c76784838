"""Real SGLang 0.5.23 servers on CPU: a PD prefill with `--enable-nsa-prefill-cp-shared-kv`, its
oracles, a decode, SGLang's router; HTTP clients for them.

Used by test_sglang_server_pd.py, test_sglang_server_hicache.py and test_sglang_server_fp8.py, and by
the demo (`scripts/demo.sh`, test/helpers/demo.py, test_demo.py). What runs, what is replaced and
why: docs/sglang_cpu_server.md.

Every server is `python -m sglang.launch_server` in its own process group (launcher, scheduler
per rank, detokenizer), started with the CPU stand-ins of `sglang_cpu_stand_ins.py` as a test-only
SGLang plugin: a dist-info written into a temporary folder on the servers' PYTHONPATH, so SGLang's
entry-point discovery finds it in every process it starts; nothing is installed. Ports are chosen
free at run time; `Cluster.stop()` kills every process group (SIGTERM, then SIGKILL) and checks
that the ports are closed again.
"""

from __future__ import annotations

import os
import re
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests

from helpers import sglang_cpu_stand_ins
from helpers import sglang_model_harness as H

TEST_DIR = Path(__file__).resolve().parents[1]  # test/: what `import helpers` needs on the path
PYTHON = sys.executable
CP = 2
PAGE = 64
CHUNK_TOKENS = 128  # --chunked-prefill-size: 2 pages, so a prefill batch can hold several requests
MAX_TOTAL_TOKENS = 16384  # --max-total-tokens: the per-rank token budget of every pool
LOG_TAIL_CHARS = 6000

# SGLang's own settings for a CPU run (not stand-ins): Mooncake over TCP on loopback, one OpenMP
# thread per process (2 cores, ~10 processes), a core-binding string for the CP ranks (SGLang
# requires one per rank when ranks outnumber NUMA nodes), no crash diagnostics (py-spy, CUDA
# coredumps: a 65 s wait before a crashed server exits), short PD failure detection.
SERVER_ENV = {
    **sglang_cpu_stand_ins.ENV,
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    # Mooncake listens on every interface whatever its host; these servers talk over loopback only,
    # and its ports come from a range below free_ports' (the range a deployment firewalls)
    "SGLANG_NSA_CP_MOONCAKE_PORTS_CONFINED": "1",
    # the PD messages keyed (the flag refuses to start without a secret unless the network is declared
    # trusted): the keyed path runs through the real servers
    "SGLANG_NSA_CP_PD_SECRET": "cpu-servers-pd-secret-0123456789abcdef",
    # MC_MIN_RPC_PORT / MC_MAX_RPC_PORT: this partition's slice of MOONCAKE_PORTS (below)
    "OMP_NUM_THREADS": "1",
    "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    # generous: on a loaded 2-core machine a decode serving one request at a time took 63 s to
    # send a queued request's bootstrap (a 60 s limit failed the request on both prefills)
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300",
    # a decode holds a failed room's pages until every prefill rank acknowledged; a dead one never does
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5",
}

# A partitioned run of the suite (scripts/run_suite.py --auto-partition-id I --auto-partition-size N
# sets NSA_CP_TEST_PARTITION=I/N) has N pytest processes starting servers at once: each takes the
# I-th of N slices of Mooncake's range and of free_ports', so no two of them pick the same port.
PARTITION_ENV = "NSA_CP_TEST_PARTITION"
MOONCAKE_PORTS = (9000, 9500)  # [low, high): below free_ports' range


def partition() -> tuple[int, int]:
    """(I, N) from NSA_CP_TEST_PARTITION=I/N; (0, 1) when unset."""
    value = os.environ.get(PARTITION_ENV, "0/1")
    part, _, size = value.partition("/")
    if not (part.isdigit() and size.isdigit() and int(part) < int(size)):
        raise ValueError(f"{PARTITION_ENV}={value!r}: must be I/N with 0 <= I < N (scripts/run_suite.py sets it "
                         "for --auto-partition-id I --auto-partition-size N); unset it for an unpartitioned run")  # fmt: skip
    return int(part), int(size)


def port_slice(low: int, high: int) -> tuple[int, int]:
    """This partition's share [low', high') of the ports [low, high)."""
    part, size = partition()
    step = (high - low) // size
    return low + part * step, low + (part + 1) * step


_MC_LOW, _MC_HIGH = port_slice(*MOONCAKE_PORTS)
SERVER_ENV.update(MC_MIN_RPC_PORT=str(_MC_LOW), MC_MAX_RPC_PORT=str(_MC_HIGH - 1))  # Mooncake's maximum: inclusive

PLUGIN_DIST = "sglang_nsa_cp_cpu_stand_ins-0.0.0.dist-info"
PLUGIN_ENTRY_POINT = "[sglang.srt.plugins]\ncpu_stand_ins = helpers.sglang_cpu_stand_ins:register\n"


# ---- the model -------------------------------------------------------------------------------------


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A character-level tokenizer for the tiny vocabulary: <s> = 0, </s> = 1 (the checkpoint's
    bos / eos), then one printable character per id (ASCII 32-126, then Latin letters from U+00C0)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xC0, 0x250)]
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars[: vocab_size - 2])}}
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one id per character
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(path)


# The forward harness's tiny DeepSeek-V3.2 with 16 index heads instead of 2. With 2, a key's index
# score sum_h w_h * relu(q_h . k) is exactly 0 whenever both ReLUs are, many keys tie at the top-k
# cutoff, and SGLang's torch top-k breaks ties by where a request sits in the batch
# (docs/sglang_cpu_forward.md): the same prompt could then decode differently alone and in a batch.
# With 16 heads an exact tie needs all 16 ReLUs at 0.
MODEL = dict(H.TINY_V32, index_n_heads=16)


# TP sizes a --device cpu server of the tiny model can run at (model_for_tp says why)
CPU_TP_SIZES = (2, 4, 8)


def model_for_tp(tp: int) -> dict:
    """`MODEL` with as many attention heads as there are TP ranks, so that it loads at TP `tp`.

    With --device cpu SGLang pads the attention heads to a multiple of the TP size (its
    configs/update_config.py `adjust_config_with_unaligned_cpu_tp`: 2 heads become 4 at TP 4), but
    the attention weight loaders pad only under its CPU engine (SGLANG_USE_CPU_ENGINE), so a
    checkpoint of 2 heads dies at TP 4 in linear.py ("start (0) + length (256) exceeds dimension
    size (128)": kv_b_proj sized for 4 heads x 64). The MLP's padded intermediate size loads (its
    loader zero-pads). SGLang's flashmla_sparse path also needs the head count to divide 64
    (dsa_backend.py pads the heads to 64), so TP must be a power of two: at TP 3 neither 2 heads
    (padded to 3) nor 3 would do. At TP 2 this is `MODEL` itself. Every server of a cluster, the
    TP 1 ones included, loads the same checkpoint."""
    if tp not in CPU_TP_SIZES:
        raise ValueError(
            f"model_for_tp({tp}): a CPU server of the tiny model runs at TP {CPU_TP_SIZES}: SGLang pads a "
            "--device cpu server's attention heads to a multiple of TP and its flashmla_sparse path needs a "
            "head count that divides 64; use one of those"
        )
    return dict(MODEL, num_attention_heads=tp, num_key_value_heads=tp)


def write_model(path: str, config: dict = MODEL) -> str:
    """The tiny checkpoint (`config`, by default `MODEL`), plus a tokenizer."""
    H.write_checkpoint(path, config)
    write_tokenizer(path, config["vocab_size"])
    return path


def write_plugin_site(path: str, entry_point: str = PLUGIN_ENTRY_POINT) -> str:
    """A folder that, on PYTHONPATH, makes SGLang's entry-point discovery load a test-only plugin
    (`cpu_stand_ins` by default; the module itself is found through the test folder)."""
    dist = Path(path) / PLUGIN_DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-nsa-cp-cpu-stand-ins\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(entry_point)
    (dist / "RECORD").write_text("")
    return path


# ---- ports and processes ---------------------------------------------------------------------------


_PORTS_GIVEN: set[int] = set()  # never hand out a port twice in one process


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now, none handed out before, all below the kernel's ephemeral
    range: a server binds its port a minute or more after this, and meanwhile every outgoing
    connection (Mooncake, ZMQ, gloo, HTTP) takes a port from that range, which once took one
    picked there. In a partitioned run, from this partition's slice only (`port_slice`): another
    process's pick is free until its server binds it."""
    (low, top), rng, ports = port_slice(10000, _ephemeral_low()), random.Random(), []
    while len(ports) < n:
        port = rng.randrange(low, top)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        ports.append(port)
    return ports


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (prctl
    PR_SET_PDEATHSIG), so a test process killed outright takes its servers along; SGLang's own
    schedulers and detokenizer already die with their launcher."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # zombies of an exited group count as gone
    out = subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    return any(not stat.startswith("Z") for stat in out)


@dataclass
class Proc:
    """One launched program in its own process group, its output in `log`."""

    name: str
    cmd: list[str]
    env: dict
    log: Path
    ports: list[int]
    popen: subprocess.Popen | None = None

    def start(self) -> "Proc":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.log.parent, preexec_fn=_die_with_parent,
            )  # fmt: skip
        return self

    @property
    def pgid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        return self.popen.poll()

    def log_text(self, since: int = 0) -> str:
        """What the process has logged, from character `since` on (a length read earlier)."""
        return self.log.read_text(errors="replace")[since:] if self.log.exists() else ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log_text()[-chars:]

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole group, SIGKILL whatever is left after `grace_s`, reap the launcher."""
        if self.popen is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if not group_alive(self.pgid):
                break
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while group_alive(self.pgid) and time.monotonic() < deadline:
                self.popen.poll()
                time.sleep(0.1)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Server(Proc):
    """`python -m sglang.launch_server` with its HTTP port first in `ports` and its torch.distributed
    store port (`--nccl-port`) second."""

    bootstrap_port: int | None = None

    @property
    def nccl_port(self) -> int:
        return self.ports[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    def ready(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def info(self) -> dict:
        return requests.get(self.url + "/get_server_info", timeout=10).json()

    def pids(self) -> list[int]:
        """Every process of this server (its process group)."""
        out = subprocess.run(["ps", "-o", "pid=", "-g", str(self.pgid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def scheduler_pids(self) -> dict[str, int]:
        """The scheduler processes of this server by process title (`sglang::scheduler_ATTN_CP1_TP1`)."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(self.pgid)], capture_output=True, text=True).stdout
        pids = {}
        for line in out.splitlines():
            pid, _, title = line.strip().partition(" ")
            if title.startswith("sglang::scheduler"):
                pids[title.strip()] = int(pid)
        return pids


# ---- the servers -----------------------------------------------------------------------------------

DSA_ARGS = [
    "--device", "cpu", "--attention-backend", "dsa", "--kv-cache-dtype", "bfloat16",
    "--dsa-prefill-backend", "flashmla_sparse", "--dsa-decode-backend", "flashmla_sparse",
    "--dsa-topk-backend", "torch",
]  # fmt: skip
CP_ARGS = ["--tp", str(CP), "--enable-prefill-cp", "--cp-strategy", "interleave", "--attn-cp-size", str(CP),
           "--moe-dense-tp-size", "1"]  # fmt: skip
PD_ARGS = ["--disaggregation-transfer-backend", "mooncake"]
# SGLang's decode on CPU is not batch-invariant: the same prompt decoded beside different requests
# can pick other greedy tokens after a few steps, on every path, a plain server included (see
# docs/sglang_cpu_server.md). Servers that decode therefore run one request at a time; the
# prefills batch freely, and the decode takes in up to 8 more requests' KV meanwhile.
ONE_AT_A_TIME = ["--max-running-requests", "1"]
DECODE_EXTRA_SLOTS = ["--disaggregation-decode-extra-slots", "8"]

# HiCache's host tier on a CP prefill (test_sglang_server_hicache.py): a device pool of
# HICACHE_DEVICE_TOKENS logical tokens (so a few prompts push a prefix out to host), a host pool
# twice that. --max-total-tokens is a rank's pool: the shared one holds 1/N of the logical capacity
# (SGLang's owner-rotating allocator spans the N ranks' pages); the replicated one holds every page.
# (A later argument wins: these --max-total-tokens override server_command's.)
HICACHE_DEVICE_TOKENS = 1024
HICACHE_ARGS = ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "kernel",
                "--hicache-mem-layout", "layer_first"]  # fmt: skip

# name -> (extra launch_server arguments, needs a bootstrap port)
ROLES = {
    "shared": (CP_ARGS + PD_ARGS + ["--disaggregation-mode", "prefill", "--enable-nsa-prefill-cp-shared-kv"], True),
    "replicated": (CP_ARGS + PD_ARGS + ["--disaggregation-mode", "prefill"], True),
    # the flag on the decode: its opt-in to shared-KV prefills (it serves the replicated one as SGLang does)
    "decode": (
        PD_ARGS
        + ["--disaggregation-mode", "decode", "--enable-nsa-prefill-cp-shared-kv"]
        + ONE_AT_A_TIME
        + DECODE_EXTRA_SLOTS,
        False,
    ),  # fmt: skip
    "single": (ONE_AT_A_TIME, False),
}
# fp8 KV (test_sglang_server_fp8.py): SGLang's fp8 DSA pool (FlashMLA's 656-byte rows) on both
# prefills and the decode, the prefill backend the flag needs with fp8 named as a deployment names it
# (these override DSA_ARGS's bfloat16). The decode keeps DSA_ARGS's flashmla_sparse: on CPU the
# FlashMLA stand-in dequantizes the fp8 rows it is handed (SM90 would take flashmla_kv).
FP8_KV_ARGS = ["--kv-cache-dtype", "fp8_e4m3"]
FP8_PREFILL_ARGS = FP8_KV_ARGS + ["--dsa-prefill-backend", "flashmla_sparse"]
ROLES["fp8_shared"] = (ROLES["shared"][0] + FP8_PREFILL_ARGS, True)
ROLES["fp8_replicated"] = (ROLES["replicated"][0] + FP8_PREFILL_ARGS, True)
ROLES["fp8_decode"] = (ROLES["decode"][0] + FP8_KV_ARGS, False)
# SGLang's own layer split (`--enable-dsa-cache-layer-split`, test_sglang_server_layer_split.py): the
# replicated prefill plus the flag; each CP rank keeps its layers' KV and one layer's remote scratch,
# at the same --max-total-tokens per rank (SGLang sizes the pool in rows of a rank, not in logical tokens)
ROLES["layer_split"] = (ROLES["replicated"][0] + ["--enable-dsa-cache-layer-split"], True)
for _flavour in ("shared", "replicated"):  # per-rank token counts for the same logical capacity
    _per_rank = HICACHE_DEVICE_TOKENS // CP if _flavour == "shared" else HICACHE_DEVICE_TOKENS
    ROLES[f"hicache_{_flavour}"] = (ROLES[_flavour][0] + HICACHE_ARGS + ["--max-total-tokens", str(_per_rank)], True)


def load(server: "Server") -> dict:
    """SGLang's live load report of the server's one DP rank (/v1/loads)."""
    (report,) = requests.get(server.url + "/v1/loads", timeout=10).json()["loads"]
    return report


def logical_capacity(server: "Server") -> int:
    """The tokens the server's scheduler admits against (SGLang's load report: logical tokens, N x a
    rank's pool under KV sharding)."""
    return load(server)["max_total_num_tokens"]


def classes_built(server: "Server") -> set[tuple[str, str]]:
    """(KV manager class, KV pool class) each of the server's PD schedulers built, as the test-only
    stand-in plugin reports them (`sglang_cpu_stand_ins.report_classes`)."""
    # class names only: two CP ranks write one log, and a line can run into the next one's timestamp
    line = re.escape(sglang_cpu_stand_ins.CLASSES_LINE) + r"manager=([\w.]+) pool=([\w.]+)"
    return set(re.findall(line, server.log_text()))


def scratch_logs(server: "Server", rank: int) -> list[str]:
    """SGLang's line about rank `rank`'s sharded pool (its scratch regions), if it built one."""
    pattern = rf"Page-interleave KV sharding enabled: shard_rank={rank} shard_size={CP} .*"
    return re.findall(pattern, server.log_text())


def one_context_scratch() -> str:
    """What the plugin's default scratch is in that line: one context of the tiny model, rounded to
    the shard group's gather span, plus one chunk."""
    span = CP * PAGE
    return f"prefix_tokens={-(-MODEL['max_position_embeddings'] // span) * span} chunk_tokens={CHUNK_TOKENS} "


def with_cp(role_args: list[str], cp: int) -> list[str]:
    """A role's arguments at CP size `cp` instead of `CP` (its --tp and --attn-cp-size, if any)."""
    out = list(role_args)
    for i, a in enumerate(out[:-1]):
        if a in ("--tp", "--attn-cp-size"):
            out[i + 1] = str(cp)
    return out


def omp_threads_bind(cp: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND with one entry per CP rank (SGLang requires one per rank when
    ranks outnumber NUMA nodes): the ranks take this process's cores in turn ("0|1" on 2 cores)."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[r % len(cores)]) for r in range(cp))


def server_command(
    model: str, port: int, role_args: list[str], bootstrap_port: int | None, nccl_port: int
) -> list[str]:
    cmd = [PYTHON, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1", "--port", str(port),
           "--nccl-port", str(nccl_port),
           *DSA_ARGS, "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--chunked-prefill-size", str(CHUNK_TOKENS),
           "--sleep-on-idle", "--skip-server-warmup", *role_args]  # fmt: skip
    if bootstrap_port is not None:
        cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return cmd


def server_env(plugin_site: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "MC_", "MOONCAKE_"))}
    env.update(SERVER_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(TEST_DIR), plugin_site, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def router_command(port: int, metrics_port: int, prefill: Server, decode: Server) -> list[str]:
    """SGLang's PD router (sglang-router, Rust) in front of one prefill and one decode; its
    Prometheus exporter on a port of its own (the default one would clash between routers)."""
    return [PYTHON, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--policy", "round_robin",
            "--request-timeout-secs", "120", "--retry-max-retries", "1", "--log-level", "warn"]  # fmt: skip


@dataclass
class Cluster:
    """The servers of one test run; start them together, stop them all.

    `cp`: the CP size of the CP roles (their --tp and --attn-cp-size; the checkpoint is
    `model_for_tp(cp)`). `extra_args`: role name -> launch arguments appended to that role's
    (later arguments win: a `--max-total-tokens` here overrides the role's and server_command's).
    `env`: variables set for every server of this cluster, over SERVER_ENV's."""

    workdir: Path
    roles: tuple[str, ...] = ("shared", "replicated", "decode", "single")
    router: bool = True
    cp: int = CP
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    servers: dict[str, Server] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    model: str = ""
    startup_s: float = 0.0  # how long start() took, for the tests' logs

    @contextmanager
    def running(self, timeout_s: float = 240.0):
        """Start every server, yield the cluster, stop them all; fail if a process group or a port
        outlives the stop (a server that leaks would poison the next test's ports)."""
        t0 = time.monotonic()
        try:
            self.start(timeout_s)
            self.startup_s = time.monotonic() - t0
            yield self
        finally:
            leftovers = self.stop()
            assert not leftovers, f"after stopping the servers: {leftovers}"

    # What a variant of this cluster (sglang_gpu_servers.GpuCluster) replaces: the model, the
    # servers' environment, each role's arguments and the command line.
    def write_model(self, path: str) -> str:
        return write_model(path, model_for_tp(self.cp))

    def server_env(self) -> dict:
        env = server_env(write_plugin_site(str(self.workdir / "plugin_site")))
        env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(self.cp)
        return env | self.env

    def role(self, name: str) -> tuple[list[str], bool]:
        role_args, needs_bootstrap = ROLES[name]
        return with_cp(role_args, self.cp) + self.extra_args.get(name, []), needs_bootstrap

    def server_command(self, port: int, role_args: list[str], bootstrap_port: int | None, nccl_port: int):
        return server_command(self.model, port, role_args, bootstrap_port, nccl_port)

    def start(self, timeout_s: float = 240.0) -> "Cluster":
        self.model = self.write_model(str(self.workdir / "model"))
        env = self.server_env()
        # SGLang's zmq sockets and temporary files go here, not into /tmp (a killed server leaves them)
        env["TMPDIR"] = str(self.workdir / "tmp")
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        for name in self.roles:
            role_args, needs_bootstrap = self.role(name)
            ports = free_ports(3 if needs_bootstrap else 2)  # HTTP, torch.distributed's store, bootstrap
            bootstrap = ports[2] if needs_bootstrap else None
            server = Server(name, self.server_command(ports[0], role_args, bootstrap, ports[1]), env,
                            self.workdir / "logs" / f"{name}.log", ports, bootstrap_port=bootstrap)  # fmt: skip
            self.servers[name] = server
            self.procs.append(server.start())
        self.wait_ready(list(self.servers.values()), timeout_s)
        if self.router:
            port, metrics_port = free_ports(2)
            router = Proc("router", router_command(port, metrics_port, self.servers["shared"], self.servers["decode"]),
                          env, self.workdir / "logs" / "router.log", [port, metrics_port])  # fmt: skip
            self.procs.append(router.start())
            self.router_url = f"http://127.0.0.1:{port}"
            self.wait_router(router, timeout_s=60)
        return self

    def wait_ready(self, servers: list[Server], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(servers)
        while waiting:
            for server in list(waiting):
                if server.exited() is not None:
                    raise RuntimeError(
                        f"{server.name} exited with {server.exited()} while starting:\n{server.log_tail()}"
                    )
                if server.ready():
                    waiting.remove(server)
            if waiting and time.monotonic() > deadline:
                tails = "\n".join(f"--- {s.name}:\n{s.log_tail(2000)}" for s in waiting)
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {[s.name for s in waiting]}\n{tails}")
            time.sleep(0.5)

    def wait_router(self, router: Proc, timeout_s: float) -> None:
        """The router registers its workers asynchronously: wait until both are healthy there."""
        deadline = time.monotonic() + timeout_s
        while True:
            if router.exited() is not None:
                raise RuntimeError(f"router exited with {router.exited()}:\n{router.log_tail()}")
            try:
                workers = requests.get(self.router_url + "/workers", timeout=2).json()["workers"]
                if sorted(w["worker_type"] for w in workers if w["is_healthy"]) == ["decode", "prefill"]:
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"router has no healthy prefill and decode after {timeout_s} s:\n{router.log_tail()}"
                )
            time.sleep(0.5)

    def log_tails(self, chars: int = 1500) -> str:
        """The end of every server's log, for failure messages."""
        return "\n".join(f"--- {p.name} ({p.log}):\n{p.log_tail(chars)}" for p in self.procs)

    def stop(self) -> list[str]:
        """Stop every process group (in parallel); return what is still alive or listening."""
        threads = [threading.Thread(target=p.stop) for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        leftovers = [f"{p.name}: process group {p.pgid} alive" for p in self.procs if p.popen and group_alive(p.pgid)]
        leftovers += [f"{p.name}: port {port} open" for p in self.procs for port in p.ports if port_open(port)]
        return leftovers


# ---- HTTP clients ----------------------------------------------------------------------------------


def greedy(max_new_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = 120, **extra) -> dict:
    """POST /generate; returns the JSON answer (raises on an HTTP error)."""
    body = {"input_ids": input_ids, "sampling_params": greedy(max_new_tokens), **extra}
    answer = requests.post(url + "/generate", json=body, timeout=timeout_s)
    answer.raise_for_status()
    return answer.json()


def generate_pd(prefill: Server, decode: Server, input_ids: list[int], max_new_tokens: int, timeout_s: float = 120,
                **extra):  # fmt: skip
    """What a PD router does, done by the client: the same request with the same bootstrap fields
    (and `extra` /generate fields) to the prefill and the decode at once. Returns (prefill answer,
    decode answer)."""
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(62), **extra}  # fmt: skip
    answers = {}

    def post(name, server):
        try:
            answers[name] = generate(server.url, input_ids, max_new_tokens, timeout_s, **boot)
        except requests.RequestException as e:
            answers[name] = e

    threads = [threading.Thread(target=post, args=a) for a in (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers["prefill"], answers["decode"]


def three_paths(cluster: Cluster, input_ids: list[int], max_new_tokens: int, timeout_s: float = 120,
                extra: dict | None = None, answers: dict | None = None) -> dict:  # fmt: skip
    """The same greedy request at once through the shared-KV PD (the cluster's router), the
    replicated PD (`generate_pd`) and the non-CP oracle ("single"). Returns each path's output ids:
    {"shared": [...], "replicated": [...], "oracle": [...]}. A path that fails raises
    AssertionError naming it, with the end of every server's log. `extra`: more /generate fields
    (e.g. logprobs); `answers`, when given, receives each path's whole JSON answer."""
    replicated, decode = cluster.servers["replicated"], cluster.servers["decode"]
    extra = extra or {}
    calls = {
        "shared": lambda: generate(cluster.router_url, input_ids, max_new_tokens, timeout_s, **extra),
        "replicated": lambda: generate_pd(replicated, decode, input_ids, max_new_tokens, timeout_s, **extra)[1],
        "oracle": lambda: generate(cluster.servers["single"].url, input_ids, max_new_tokens, timeout_s, **extra),
    }
    whole = answers_of(cluster, calls, len(input_ids))
    if answers is not None:
        answers.update(whole)
    return {path: answer["output_ids"] for path, answer in whole.items()}


def answers_of(cluster: Cluster, calls: dict, prompt_tokens: int) -> dict:
    """Each path's call at once; returns each path's JSON answer. A path that fails raises
    AssertionError naming it, with the end of every server's log."""
    with futures.ThreadPoolExecutor(len(calls)) as pool:
        pending = {path: pool.submit(call) for path, call in calls.items()}
        out = {}
        for path, answer in pending.items():
            try:
                result = answer.result()
                if isinstance(result, Exception):  # generate_pd hands back the decode's failure
                    raise result
                out[path] = result
            except requests.RequestException as e:
                raise AssertionError(
                    f"{path} path, prompt of {prompt_tokens} tokens: {e!r}\n{cluster.log_tails()}"
                ) from e
    return out


def complete(url: str, prompt: str | list[int], max_tokens: int, timeout_s: float = 120) -> dict:
    """POST /v1/completions (OpenAI-compatible), greedy."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    answer = requests.post(url + "/v1/completions", json=body, timeout=timeout_s)
    answer.raise_for_status()
    return answer.json()


def prompt_ids(length: int, seed: int, vocab_size: int | None = None) -> list[int]:
    """Token ids 2..vocab-1 (no bos / eos; `MODEL`'s vocabulary unless given), reproducible."""
    g = random.Random(seed)
    top = vocab_size or MODEL["vocab_size"]
    return [g.randrange(2, top) for _ in range(length)]
