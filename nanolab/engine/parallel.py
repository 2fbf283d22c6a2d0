"""Tensor-parallel execution: one process per rank, rank 0 coordinating.

Rank 0 is the caller's process and runs the whole engine (scheduler, sampler, the API) over its
shard of the model (`model.parallel`). Every other rank is a worker process that holds its own
shard, its own share of the KV cache (its KV heads) and a `ModelRunner`, and runs the forward
rank 0 tells it to, in step with it: the collectives inside the forward meet rank 0's.

Between each step's plan and its forward, rank 0's `LeaderRunner` sends a `StepCall` down each
worker's stdin pipe (`Channel`): the runner method, the rows with their block lists as rank 0's
block manager left them, and a varlen step's token ids. A decode step's ids go by a broadcast over
the group instead, queued on the stream, so asynchronous scheduling never waits for them. A pipe
has no timeout, so a worker waits for the next step as long as the server stays idle, and it ends
when the pipe does: rank 0 gone is end of file, a worker gone is a broken pipe at rank 0's next
send. A worker's
`FollowerBlockManager` allocates nothing: it adopts those tables and takes each new block from the
call, so the worker's plan is rank 0's and nothing is decided twice.

The process group is initialised the standard way (`env://`: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), as torchrun sets it; `Workers` sets it for the workers it starts on this host. The
pipes are what ties the workers to this host: ranks on other hosts would need the calls carried
over a socket instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from nanolab.engine.block_manager import BlockManager, BlockTable, cdiv
from nanolab.engine.kv_cache import KVCache
from nanolab.engine.runner import ModelRunner, compile_decode
from nanolab.model.parallel import TensorParallel

WORKER_ENTRY = "from nanolab.engine.parallel import worker_main; worker_main()"
# Kept off in every process this module starts, as the device notes require of NCCL over NVLink.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass
class StepCall:
    """One forward for the workers: `kind` "varlen", "verify" or "decode"; per row, its blocks after
    rank 0 planned the step and its token count before; a varlen or verify step's ids (each row's
    fed tokens). A decode step's ids follow by a broadcast over the group (`Channel.send_ids`)."""

    kind: str
    rows: list[int]
    blocks: list[list[int]]
    tokens_before: list[int]
    ids: list[list[int]] | None = None
    counts: list[int] | None = None
    sampled: list[bool] | None = None
    all_logits: list[bool] | None = None


@dataclasses.dataclass
class WorkerSpec:
    """What a worker needs to build its rank: the weights, the cache's block size and rows, and how
    to run. The pool's size follows once rank 0 has measured what its shard left free."""

    path: str
    dtype: torch.dtype
    device_type: str
    block_size: int
    max_num_seqs: int
    read: str
    prepack: bool | None = None
    cuda_graphs: bool = False  # captured on every rank in the same order, so their collectives pair up
    compile: bool = False  # decode steps through inductor (`runner.compile_decode`), as rank 0's
    timeout_s: float | None = None  # the group's collective timeout (`join_group`); None: torch's
    quantization: str | None = None  # as rank 0's (`load_model`)


class FollowerBlockManager(BlockManager):
    """A worker's block manager. It never chooses a block: `adopt` sets each row of a call to rank
    0's table before the step, and `grow` takes each new cell's block from what rank 0 gave the step."""

    def __init__(self, num_blocks: int, block_size: int, max_rows: int) -> None:
        super().__init__(num_blocks, block_size, max_rows)
        self._given: dict[tuple[int, int], int] = {}

    def adopt(self, call: StepCall) -> None:
        for row, blocks, before in zip(call.rows, call.blocks, call.tokens_before, strict=True):
            table = BlockTable(self.block_size)
            kept = cdiv(before, self.block_size)
            # Cells this worker did not grow itself (a prefix rank 0 shared from its cache) go to the
            # device table too: those past what the row held here last, or all of them for a new row.
            prev = self.tables[row]
            known = len(prev.blocks) if prev is not None and prev.blocks == list(blocks[:len(prev.blocks)]) else 0
            self._new.update({(row, col): blocks[col] for col in range(min(known, kept), kept)})
            table.blocks, table.num_tokens = list(blocks[:kept]), before
            self.tables[row] = table
            self._given.update({(row, col): b for col, b in enumerate(blocks) if col >= kept})

    def _take_block(self, row: int, column: int) -> int:
        return self._given.pop((row, column))  # KeyError: rank 0 sent no block for this cell


class LeaderRunner(ModelRunner):
    """Rank 0's runner: before each forward, the workers hear what to run (`StepCall`); `close`
    sends them home."""

    def __init__(self, *args, workers: Workers, **kwargs) -> None:
        self.workers, self.channel = workers, workers.channel
        super().__init__(*args, **kwargs)

    def close(self) -> None:
        self.workers.close()

    def run_varlen(self, *args, **kwargs) -> torch.Tensor:
        with self._group_or_abort():
            return super().run_varlen(*args, **kwargs)

    def decode(self, *args, **kwargs) -> torch.Tensor:
        with self._group_or_abort():
            return super().decode(*args, **kwargs)

    def _verify_decode(self, *args, **kwargs) -> torch.Tensor:
        with self._group_or_abort():
            return super()._verify_decode(*args, **kwargs)

    @contextlib.contextmanager
    def _group_or_abort(self):
        """A forward that fails on rank 0 after its call went out leaves the workers inside a
        collective rank 0 will never join: the group is ended (`Workers.abort`), so every later
        step fails at once with the reason instead of hanging."""
        if self.workers.broken:
            raise RuntimeError(f"the tensor-parallel group has ended: {self.workers.broken}")
        try:
            yield
        except Exception as e:
            # A worker that exited shows as a broken pipe, or as a collective failing on rank 0.
            gone = self.workers.exited(wait_s=5.0 if isinstance(e, WorkerExited) else 0.5)
            why = (f"a worker has exited: {', '.join(gone)}" if gone
                   else f"rank 0's forward failed ({type(e).__name__}: {e})")
            self.workers.abort(why)
            if gone:
                raise RuntimeError(f"the tensor-parallel group has ended: {why}") from e
            raise

    def planned(self, kind, seqs, ids, counts, sampled, all_logits=None) -> None:
        rows = [s.row for s in seqs]
        tables = [self.kv_cache.blocks.table(r) for r in rows]
        fed = [1] * len(rows) if kind == "decode" else counts
        call = StepCall(kind, rows, [list(t.blocks) for t in tables],
                        [t.num_tokens - n for t, n in zip(tables, fed, strict=True)], counts=counts, sampled=sampled,
                        all_logits=all_logits)
        if kind != "decode":  # the fed tokens, each row's
            starts = list(itertools.accumulate(counts, initial=0))
            call.ids = [ids[a:b] for a, b in itertools.pairwise(starts)]
        self.channel.send(call)
        if kind == "decode":  # a tensor, on CUDA perhaps still being sampled: never read on the host here
            self.channel.send_ids(ids[: len(rows)].reshape(-1, 1))


class Channel:
    """Rank 0 to the workers: host objects pickled down each worker's stdin pipe (`writers`, at rank
    0) or read from this worker's (`reader`), and a decode step's ids broadcast over the group."""

    def __init__(self, device: torch.device, writers=(), reader=None) -> None:
        self.device, self.writers, self.reader = device, list(writers), reader

    def send(self, call) -> None:
        """To every worker; a worker that has exited raises `WorkerExited`."""
        data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.writers, start=1):
            try:
                pipe.write(data)
                pipe.flush()
            except (BrokenPipeError, ValueError) as e:  # ValueError: the pipe was closed
                raise WorkerExited(rank) from e

    def receive(self):
        """The next object from rank 0, or None when rank 0 is gone (end of the pipe)."""
        try:
            return pickle.load(self.reader)
        except EOFError:
            return None

    def send_ids(self, ids: torch.Tensor) -> None:
        """A decode step's ids [rows, 1] to every rank, queued on the stream like the step itself."""
        dist.broadcast(ids.to(torch.int64).contiguous(), src=0)

    def receive_ids(self, rows: int) -> torch.Tensor:
        ids = torch.empty((rows, 1), dtype=torch.int64, device=self.device)
        dist.broadcast(ids, src=0)
        return ids


class WorkerExited(RuntimeError):
    """Rank 0 found a worker's pipe broken: the worker has exited."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"tensor-parallel worker rank {rank} has exited")
        self.rank = rank


class FedRow:
    """A worker's stand-in for a sequence of a varlen or verify step: its row and the ids rank 0 fed
    it this step, which are all of its tokens the step reads (`span`, as `Sequence.span`)."""

    __slots__ = ("row", "ids")

    def __init__(self, row: int, ids: list[int]) -> None:
        self.row, self.ids = row, ids

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def span(self, start: int, stop: int) -> list[int]:
        return self.ids[start:stop]


def follow(runner: ModelRunner, channel: Channel) -> None:
    """A worker's loop: run each forward rank 0 sends, until it sends None."""
    blocks = runner.kv_cache.blocks
    while (call := channel.receive()) is not None:
        blocks.adopt(call)
        if call.kind in ("varlen", "verify"):
            seqs = [FedRow(r, ids) for r, ids in zip(call.rows, call.ids, strict=True)]
            if call.kind == "varlen":
                runner.run_varlen(seqs, call.counts, [0] * len(seqs), call.sampled, call.all_logits)
            else:  # a decode step of a batch row a fed token, planned as rank 0 planned it
                runner._verify_decode(seqs, call.counts)
        else:
            seqs = [SimpleNamespace(row=r) for r in call.rows]
            runner.decode(seqs, channel.receive_ids(len(seqs)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def join_group(rank: int, world_size: int, device_type: str, timeout_s: float | None = None) -> TensorParallel:
    """This process's rank in the group `env://` describes. `timeout_s` bounds a collective a
    peer never joins (None: torch's defaults); waiting for the next step is not one."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    device = rank_device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(backend_for(device_type), init_method="env://", rank=rank, world_size=world_size,
                            **timeout)
    # One collective now, eagerly: NCCL sets its communicator up on the first one, which must not
    # be inside a graph capture.
    dist.all_reduce(torch.zeros(1, device=device))
    return TensorParallel(rank, world_size)


def worker_main() -> None:
    """A worker process's entry: its rank and spec arrive pickled on stdin (`Workers`), and then
    rank 0's calls, until None or the end of the pipe."""
    from nanolab.model.llama import load_model

    faulthandler.enable()  # a crash prints its traceback; SIGUSR1 prints where every thread is
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stdin = sys.stdin.buffer
    rank, world_size, spec = pickle.load(stdin)
    tp = join_group(rank, world_size, spec.device_type, spec.timeout_s)
    channel = Channel(rank_device(spec.device_type, rank), reader=stdin)
    try:
        model = load_model(spec.path, dtype=spec.dtype, device=channel.device, prepack=spec.prepack, tp=tp,
                           quantization=spec.quantization)
        sizes = channel.receive()  # `Workers.size_caches`, or None: rank 0 failed before it got there
        if sizes is None:
            return
        num_blocks, max_model_len = sizes
        blocks = FollowerBlockManager(num_blocks, spec.block_size, spec.max_num_seqs)
        kv_cache = KVCache(blocks, num_layers=model.config.num_hidden_layers, num_kv_heads=model.num_kv_heads,
                           head_dim=model.config.head_dim, max_model_len=max_model_len, dtype=spec.dtype,
                           device=channel.device, read=spec.read)
        forward = compile_decode(model) if spec.compile else None
        follow(ModelRunner(model, kv_cache, forward=forward, cuda_graphs=spec.cuda_graphs, progress=False), channel)
    finally:
        dist.destroy_process_group()


class Workers:
    """The worker processes of a tensor-parallel group on this host, rank 0 being this process:
    started as fresh interpreters (not multiprocessing children, so a daemonic process such as the
    server's engine core can start them too), joined over `env://`, and fed through their stdin
    pipes (`Channel`); `close` sends them home. A worker whose rank 0 dies reads the end of its
    pipe and leaves."""

    def __init__(self, world_size: int, spec: WorkerSpec) -> None:
        self.world_size = world_size
        group_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
                     **NCCL_ENV}
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding nanolab/
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self.processes = []
        for rank in range(1, world_size):
            env = {**os.environ, **group_env, "RANK": str(rank), "PYTHONPATH": path}
            p = subprocess.Popen([sys.executable, "-c", WORKER_ENTRY], stdin=subprocess.PIPE, env=env)
            pickle.dump((rank, world_size, spec), p.stdin)
            p.stdin.flush()
            self.processes.append(p)
        self.closed = False
        self.broken: str | None = None  # why the group ended, once it has
        os.environ.update(group_env, RANK="0")
        try:
            self.tp = join_group(0, world_size, spec.device_type, spec.timeout_s)
        except BaseException:
            self._end()
            raise
        self.channel = Channel(rank_device(spec.device_type, 0), writers=[p.stdin for p in self.processes])

    def size_caches(self, num_blocks: int, max_model_len: int) -> None:
        """Every worker's pool: as many blocks as rank 0's (each holds its own KV heads' share)."""
        self.channel.send((num_blocks, max_model_len))

    def exited(self, wait_s: float = 0.0) -> list[str]:
        """The workers that have exited, as "rank r (exit code c)", after up to `wait_s` seconds for
        one to finish exiting."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [f"rank {rank} (exit code {p.returncode})"
                    for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)

    def abort(self, reason: str) -> None:
        """End the group without the workers' help (they may be waiting inside a collective): kill
        them and leave the group."""
        self.broken = reason
        if self.closed:
            return
        self.closed = True
        self._end()
        dist.destroy_process_group()

    def _end(self) -> None:
        for p in self.processes:
            p.kill()
            p.wait()
            with contextlib.suppress(OSError):  # a broken pipe still holding a call's bytes
                p.stdin.close()

    def close(self, timeout: float = 30.0) -> None:
        """Tell every worker to stop, wait for them, and leave the group. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            with contextlib.suppress(WorkerExited):
                self.channel.send(None)
        finally:
            for p in self.processes:
                with contextlib.suppress(OSError):
                    p.stdin.close()
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            dist.destroy_process_group()
