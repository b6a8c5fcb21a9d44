"""Where helpers are forked from: this process (one Python thread at iter()), the zygote (a copy
taken while the loader was built and it ran one thread), or the forkserver.

Each case runs a script in a fresh interpreter, where building the loader forks the zygote (in
this test process other tests' threads decide whether it can start).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest

import threadloader

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the zygote is Linux-only")

_PRELUDE = """
import os, signal, sys, time
import psutil, torch
from threadloader import ThreadDataLoader
from threadloader.isolation import zygote
import multiprocessing.forkserver as forkserver


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = torch.arange(60.0).reshape(30, 2)  # a tensor: travels as a descriptor
        self.scale = 1.0

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i] * self.scale + torch.rand(1)


def loader(**kwargs):
    kwargs = {"batch_size": 4, "num_workers": 2, "shuffle": True,
              "generator": torch.Generator().manual_seed(7), **kwargs}
    return ThreadDataLoader(Rows(), **kwargs)


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class another_thread:
    # A Python thread running meanwhile: this process must not fork, the zygote forks.

    def __enter__(self):
        import threading
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stop.wait)
        self.thread.start()

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def parents(it):
    return {psutil.Process(pid).ppid() for pid in it.helper_pids}


def print_zygote_epoch(loader):
    # An epoch while another thread runs: whether the zygote forked its helpers, the batches.
    with another_thread():
        it = iter(loader)
        print("zygote", parents(it) == {zygote.server_pid()}, [b.tolist() for b in it])


def read_all(dup):
    with os.fdopen(dup.detach(), "rb") as f:
        return f.read()
"""


def _run(tmp_path: Any, body: str, env: dict[str, str] | None = None) -> list[str]:
    """Run ``body`` under the main guard of a script that starts with ``_PRELUDE``."""
    guarded = "\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), "    ")
    done = _run_script(tmp_path, _PRELUDE + guarded, env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _run_script(
    tmp_path: Any, source: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as ``train.py`` in a fresh interpreter that imports this threadloader."""
    script = tmp_path / "train.py"
    script.write_text(source)
    repo = str(pathlib.Path(threadloader.__file__).parents[1])
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(script)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=full_env,
    )  # fmt: skip


def test_helpers_are_forked_from_the_zygote_while_another_thread_runs(tmp_path: Any) -> None:
    """Another Python thread at iter(): helpers come from the zygote, and their batches (tensor
    data passed as descriptors, per-worker RNG draws) equal the in-process threads'."""
    out = _run(
        tmp_path,
        """
        threads = loader()
        iso = loader(isolation="process", helpers=2)
        print("zygote", zygote.server_pid() is not None)
        with another_thread():
            it = iter(iso)
            print("parents", parents(it) == {zygote.server_pid()})
            print("same", same(list(it), list(threads)))
            print("again", same(list(iso), list(threads)))
        print("forkserver", forkserver._forkserver._forkserver_pid is not None)
        """,
    )
    assert out == [
        "zygote", "True", "parents", "True", "same", "True", "again", "True",
        "forkserver", "False",
    ]  # fmt: skip


def test_helpers_are_forked_from_the_training_process_when_it_runs_one_thread(
    tmp_path: Any,
) -> None:
    """Only the main thread at iter(): helpers are forked from this process, as torch's workers
    are, and give the in-process threads' batches."""
    out = _run(
        tmp_path,
        """
        threads = loader()
        iso = loader(isolation="process", helpers=2)
        it = iter(iso)
        print("parents", parents(it) == {os.getpid()})
        print("same", same(list(it), list(threads)))
        """,
    )
    assert out == ["parents", "True", "same", "True"]


def test_helpers_see_the_dataset_as_iter_finds_it(tmp_path: Any) -> None:
    """The dataset is the one iter() finds, not the zygote's copy taken when the loader was
    built: a change made after building the loader reaches the helpers, forked either way."""
    out = _run(
        tmp_path,
        """
        iso, ref = loader(isolation="process"), loader()
        iso.dataset.scale = ref.dataset.scale = 100.0
        print("fork", same(list(iso), list(ref)))
        iso.dataset.scale = ref.dataset.scale = 1000.0
        with another_thread():
            print("zygote", same(list(iso), list(ref)))
        """,
    )
    assert out == ["fork", "True", "zygote", "True"]


def test_the_zygote_holds_none_of_the_training_process_pipes(tmp_path: Any) -> None:
    """A pipe the script closes reaches EOF: the zygote's inherited copy was let go."""
    out = _run(
        tmp_path,
        """
        r, w = os.pipe()
        iso = loader(isolation="process")
        assert zygote.server_pid() is not None
        os.close(w)
        import select
        ready, _, _ = select.select([r], [], [], 10)
        print("eof", bool(ready) and os.read(r, 1) == b"")
        print("batches", len(list(iso)))
        """,
    )
    assert out == ["eof", "True", "batches", "8"]


def test_a_process_forked_from_the_training_process_does_not_keep_the_zygote(
    tmp_path: Any,
) -> None:
    """Processes forked from the training process (torch's persistent DataLoader workers here,
    and a helper forked from it) close their copies of its end of the zygote's socket: the
    zygote exits as that end closes, and exit does not wait for it (it waited its 1 s)."""
    out = _run(
        tmp_path,
        """
        iso = loader(isolation="process", persistent_workers=True)
        print("batches", len(list(iso)))
        server = zygote.server_pid()
        torch_workers = iter(torch.utils.data.DataLoader(
            Rows(), batch_size=4, num_workers=2, persistent_workers=True,
            multiprocessing_context="fork",
        ))
        next(torch_workers)
        start = time.monotonic()
        zygote.shutdown()  # closes this end and waits for the zygote to exit
        print("zygote", server is not None, time.monotonic() - start < 2)
        print("batches", len(list(iso)))
        """,
    )
    assert out == ["batches", "8", "zygote", "True", "True", "batches", "8"]


def test_a_dead_zygote_leaves_helpers_to_the_forkserver(tmp_path: Any) -> None:
    """The zygote killed while another thread runs: the next epoch starts its helpers from the
    forkserver and gives the same batches."""
    out = _run(
        tmp_path,
        """
        iso, threads = loader(isolation="process"), loader()
        with another_thread():
            print("first", same(list(iso), list(threads)))
            os.kill(zygote.server_pid(), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while zygote.running() and time.monotonic() < deadline:
                time.sleep(0.01)
            print("running", zygote.running())
            print("same", same(list(iso), list(threads)))
        print("forkserver", forkserver._forkserver._forkserver_pid is not None)
        """,
    )
    assert out == ["first", "True", "running", "False", "same", "True", "forkserver", "True"]


def test_a_helper_start_cut_short_by_ctrl_c_leaves_later_helpers_to_the_forkserver(
    tmp_path: Any,
) -> None:
    """A Ctrl-C while a start streams to the zygote leaves half a request there: the zygote is
    given up (it would read the next request out of step), and the next epoch's helpers come
    from the forkserver with the same batches."""
    out = _run(
        tmp_path,
        """
        class CutShort:  # the zygote's socket, interrupted while a request's payload streams
            def __init__(self, sock):
                self.sock = sock
            def __getattr__(self, name):
                return getattr(self.sock, name)
            def sendall(self, data):
                if len(data) > 1000:
                    self.sock.sendall(bytes(data)[:100])
                    raise KeyboardInterrupt
                self.sock.sendall(data)

        iso = loader(isolation="process")
        with another_thread():
            zygote._server.sock = CutShort(zygote._server.sock)
            try:
                iter(iso)
                print("started")
            except KeyboardInterrupt:
                print("interrupted")
            print("running", zygote.running())
            # the interrupted iter() drew its base seed: the reference starts where it left off
            generator = torch.Generator()
            generator.set_state(iso.generator.get_state())
            print("same", same(list(iso), list(loader(generator=generator))))
        print("forkserver", forkserver._forkserver._forkserver_pid is not None)
        """,
    )
    assert out == ["interrupted", "running", "False", "same", "True", "forkserver", "True"]


def test_a_forkserver_a_ctrl_c_killed_while_it_imported_is_started_again(tmp_path: Any) -> None:
    """A terminal's Ctrl-C kills a forkserver still importing its preload; an iter() after the
    loop that Ctrl-C stopped finds it dying (alive when checked, gone under the start): a new
    forkserver starts the helpers, with the same batches, instead of an ``EOFError``."""
    (tmp_path / "slow_preload.py").write_text(
        textwrap.dedent(
            """
            import os, time
            if not os.path.exists("importing"):  # the first forkserver only
                open("importing", "w").close()
                try:
                    time.sleep(60)
                except KeyboardInterrupt:
                    time.sleep(1.0)  # dies slowly, as one unwinding half-imported torch does
                    raise
            """
        )
    )
    out = _run(
        tmp_path,
        """
        import multiprocessing
        multiprocessing.set_forkserver_preload(["slow_preload"])
        iso = loader(isolation="process", multiprocessing_context="forkserver")  # starts it
        first = forkserver._forkserver._forkserver_pid
        while not os.path.exists("importing"):
            time.sleep(0.01)
        os.kill(first, signal.SIGINT)  # the Ctrl-C, which the training loop took too
        print("same", same(list(iso), list(loader())))
        print("new", forkserver._forkserver._forkserver_pid not in (None, first))
        """,
    )
    assert out == ["same", "True", "new", "True"]


def test_helpers_start_while_the_training_process_has_over_1024_files_open(
    tmp_path: Any,
) -> None:
    """Descriptors past 1,023 (a process with many files open) work: the waits use poll."""
    out = _run(
        tmp_path,
        """
        iso, threads = loader(isolation="process"), loader()
        held = [open(os.devnull) for _ in range(1100)]
        with another_thread():
            it = iter(iso)
            print("fd", it._links.links[0].process.sentinel > 1024)
            print("same", same(list(it), list(threads)))
        print("zygote", zygote.running())
        """,
    )
    assert out == ["fd", "True", "same", "True", "zygote", "True"]


def test_a_killed_helper_reports_its_signal(tmp_path: Any) -> None:
    """The exit code the zygote reaps reaches the training process's error."""
    out = _run(
        tmp_path,
        """
        iso = loader(isolation="process")
        with another_thread():
            it = iter(iso)
            next(it)
            print("zygote's", parents(it) == {zygote.server_pid()})
            os.kill(it.helper_pid, signal.SIGKILL)
            try:
                list(it)
            except RuntimeError as exc:
                print("died", "exit code -9" in str(exc))
        """,
    )
    assert out == ["zygote's", "True", "died", "True"]


def test_the_switch_off_uses_the_forkserver(tmp_path: Any) -> None:
    """THREADLOADER_ZYGOTE=0: never fork this process nor a zygote; helpers come from the
    forkserver."""
    out = _run(
        tmp_path,
        """
        iso = loader(isolation="process")
        it = iter(iso)
        print("zygote", zygote.server_pid() is not None)
        print("forkserver's", parents(it) == {forkserver._forkserver._forkserver_pid})
        print("same", same(list(it), list(loader())))
        """,
        env={"THREADLOADER_ZYGOTE": "0"},
    )
    assert out == ["zygote", "False", "forkserver's", "True", "same", "True"]


def test_the_forkserver_leaves_with_the_training_process(tmp_path: Any) -> None:
    """Whatever reads the training process's output to its end waits for the forkserver too,
    which holds it: once the training process is gone, the forkserver leaves at once, running
    no exit teardown (here a 90 s exit handler of a module the user preloads into it stands in
    for torch's ~0.7 s)."""
    (tmp_path / "slow_exit.py").write_text(textwrap.dedent("""
        import atexit, sys, time

        if any("from multiprocessing.forkserver import main" in a for a in sys.orig_argv):
            atexit.register(time.sleep, 90)
        """))  # fmt: skip
    script = tmp_path / "train.py"
    script.write_text(_PRELUDE + textwrap.dedent("""
        if __name__ == "__main__":
            import multiprocessing
            multiprocessing.set_forkserver_preload(["__main__", "slow_exit"])
            print(same(list(loader(isolation="process")), list(loader())))
        """))  # fmt: skip
    repo = str(pathlib.Path(threadloader.__file__).parents[1])
    env = {**os.environ, "THREADLOADER_ZYGOTE": "0"}
    env["PYTHONPATH"] = os.pathsep.join([repo, str(tmp_path), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


def test_auto_starts_no_helper_server_when_built(tmp_path: Any) -> None:
    """isolation='auto' (the default) may never need a helper: building it forks no zygote
    (whose copy of the process costs memory as the process writes) and starts no forkserver."""
    out = _run(
        tmp_path,
        """
        auto = loader(isolation="auto")
        default = loader()
        print("zygote", zygote.server_pid() is not None)
        print("forkserver", forkserver._forkserver._forkserver_pid is not None)
        """,
    )
    assert out == ["zygote", "False", "forkserver", "False"]


def test_auto_with_a_fork_context_forks_this_process_running_one_thread(tmp_path: Any) -> None:
    """multiprocessing_context='fork' under "auto": a move forks the helpers from this process
    while it runs one Python thread, as torch's fork-started workers."""
    out = _run(
        tmp_path,
        """
        from threadloader.isolation import auto as policy
        policy.held_the_gil = lambda stats: True
        policy.MIN_EPOCH_S = policy.MIN_EPOCH_S_SERVER = 0.0
        policy.loop_pace = lambda stats: 100.0
        fork = loader(multiprocessing_context="fork")
        ref = loader(isolation="threads")
        first, second = list(fork), list(fork)
        print("mode", fork.stats().mode)
        print("same", same(first, list(ref)) and same(second, list(ref)))
        it = iter(fork)
        print("forked_here", parents(it) == {os.getpid()})
        """,
    )
    assert out == ["mode", "process", "same", "True", "forked_here", "True"]


def test_the_zygote_ends_with_the_training_process(tmp_path: Any) -> None:
    """SIGKILL of the training process: the zygote sees its socket end and exits; SIGINT (a
    terminal's Ctrl-C reaches the whole group) does not end it."""
    script = tmp_path / "train.py"
    script.write_text(
        _PRELUDE
        + textwrap.dedent(
            """
            if __name__ == "__main__":
                iso = loader(isolation="process")
                print(zygote.server_pid(), flush=True)
                time.sleep(60)
            """
        )
    )
    repo = str(pathlib.Path(threadloader.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        server = int(proc.stdout.readline())
        deadline = time.monotonic() + 10  # SIGINT is ignored once the zygote runs its loop
        while psutil.Process(server).name() != "threadloader-zy" and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(server, signal.SIGINT)
        time.sleep(0.2)
        assert psutil.Process(server).status() != psutil.STATUS_ZOMBIE
    finally:
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(server) and time.monotonic() < deadline:
        try:
            if psutil.Process(server).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    gone = not psutil.pid_exists(server) or psutil.Process(server).status() == "zombie"
    assert gone


def test_a_zygote_helper_keeps_nothing_pickling_made_in_the_training_process(
    tmp_path: Any,
) -> None:
    """A dataset that pickles as a tensor it makes: the zygote's process object keeps its
    arguments for the helper's life, but not what pickling made, nor the dataset (a helper
    from the zygote may hold a large copy of it for as long as the epoch runs)."""
    out = _run(
        tmp_path,
        """
        import gc, weakref
        made = []

        def rows(values):
            return Rows()

        class MadeWhenPickled(Rows):
            def __reduce__(self):
                values = torch.arange(8.0)
                made.append(weakref.ref(values))
                return rows, (values,)

        iso = ThreadDataLoader(MadeWhenPickled(), batch_size=4, num_workers=2,
                               isolation="process", helpers=2)
        with another_thread():
            it = iter(iso)
            next(it)
            gc.collect()
            print("pickled", len(made), "alive", sum(ref() is not None for ref in made))
            del it
        """,
    )
    assert out == ["pickled", "2", "alive", "0"]


def test_a_zygote_helper_does_not_keep_the_bytes_it_was_started_with(tmp_path: Any) -> None:
    """The pickled start a helper receives from the zygote is dropped, there and in the zygote,
    once unpickled: a dataset holding a 96 MB blob costs the helper and the zygote one copy of
    it, not two, for as long as the helper runs."""
    out = _run(
        tmp_path,
        """
        class Blob(Rows):
            def __init__(self, size):
                super().__init__()
                self.blob = os.urandom(size)  # incompressible: each copy is resident

        def helper_and_zygote_pss(size):
            iso = ThreadDataLoader(Blob(size), batch_size=4, num_workers=1,
                                   isolation="process", helpers=1)
            with another_thread():
                it = iter(iso)
                next(it)
                assert parents(it) == {zygote.server_pid()}
                pids = [zygote.server_pid(), it.helper_pids[0]]
                pss = sum(psutil.Process(pid).memory_full_info().pss for pid in pids)
                del it
            return pss

        ThreadDataLoader(Rows(), num_workers=1, isolation="process")  # starts the zygote
        small, large = helper_and_zygote_pss(1), helper_and_zygote_pss(96 << 20)
        print("copies", round((large - small) / (96 << 20), 1))
        """,
    )
    assert out[0] == "copies" and float(out[1]) < 1.5, out


def test_the_training_process_keeps_no_pickle_of_the_dataset_once_helpers_started(
    tmp_path: Any,
) -> None:
    """The one pickle of the dataset that helpers started together receive is dropped once they
    started, though the zygote's process objects keep their arguments for the helpers' life."""
    out = _run(
        tmp_path,
        """
        import gc

        class Blob(torch.utils.data.Dataset):
            # No tensor: the one pickle can serve both helpers.
            def __init__(self, size):
                self.blob = os.urandom(size)

            def __len__(self):
                return 8

            def __getitem__(self, i):
                return self.blob[i]

        size = 96 << 20
        iso = ThreadDataLoader(Blob(size), batch_size=4, num_workers=2,
                               isolation="process", helpers=2)
        with another_thread():
            gc.collect()
            before = psutil.Process().memory_full_info().uss
            it = iter(iso)
            next(it)
            assert parents(it) == {zygote.server_pid()}
            gc.collect()
            kept = psutil.Process().memory_full_info().uss - before
            print("kept", round(kept / size, 1))
            del it
        """,
    )
    assert out[0] == "kept" and float(out[1]) < 0.5, out


def test_a_descriptor_that_pickling_made_outside_torch_reaches_the_helper(tmp_path: Any) -> None:
    """A dataset whose ``__getstate__`` makes an object that owns a file descriptor and pickles
    as it (``DupFd``): the object lives until the helper has been launched with the descriptor,
    and the helper reads the file through it."""
    out = _run(
        tmp_path,
        """
        from multiprocessing.reduction import DupFd

        path = os.path.join(os.getcwd(), "source.bin")
        with open(path, "wb") as f:
            f.write(bytes(range(10, 18)))

        class FdOwner:
            def __init__(self):
                self.fd = os.open(path, os.O_RDONLY)

            def __del__(self):
                os.close(self.fd)

            def __reduce__(self):
                return read_all, (DupFd(self.fd),)

        class FromFd(torch.utils.data.Dataset):
            def __getstate__(self):
                return {"data": FdOwner()}  # made while pickling, held by the pickle alone

            def __setstate__(self, state):
                data = state["data"]
                if isinstance(data, FdOwner):  # a worker's copy.copy: nothing was pickled
                    data = os.pread(data.fd, 64, 0)
                self.data = data

            def __len__(self):
                return 4

            def __getitem__(self, i):
                return torch.tensor(list(self.data[i * 2:i * 2 + 2]))

        iso = ThreadDataLoader(FromFd(), batch_size=2, num_workers=2, isolation="process",
                               helpers=2, timeout=30)
        with another_thread():
            print("batches", [b.tolist() for b in iso])
            print("zygote", zygote.running())
        """,
    )
    assert out == ["batches", "[[[10,", "11],", "[12,", "13]],", "[[14,", "15],", "[16,",
                   "17]]]", "zygote", "True"]  # fmt: skip


def test_zygote_helpers_import_and_open_as_the_training_process_does_at_iter(
    tmp_path: Any,
) -> None:
    """After the zygote's fork the script adds a folder to ``sys.path`` (the dataset's module is
    there) and changes directory (the dataset opens a relative path): helpers from the zygote
    import that module and open that file, as the training process would."""
    later = tmp_path / "later"
    later.mkdir()
    (later / "late_dataset.py").write_text(
        textwrap.dedent(
            """
            import torch

            class FromFile(torch.utils.data.Dataset):
                def __len__(self):
                    return 4

                def __getitem__(self, i):
                    with open("values.txt") as f:  # relative to the working directory
                        return int(f.read().split()[i])
            """
        )
    )
    (later / "values.txt").write_text("10 11 12 13")
    out = _run(
        tmp_path,
        f"""
        ThreadDataLoader(Rows(), num_workers=1, isolation="process")  # the zygote forks here
        sys.path.insert(0, {str(later)!r})
        os.chdir({str(later)!r})
        from late_dataset import FromFile

        iso = ThreadDataLoader(FromFile(), batch_size=2, num_workers=2, isolation="process",
                               helpers=2, timeout=30)
        with another_thread():
            it = iter(iso)
            print("parents", parents(it) == {{zygote.server_pid()}})
            print("batches", [b.tolist() for b in it])
        """,
    )
    assert out == ["parents", "True", "batches", "[[10,", "11],", "[12,", "13]]"]


def test_a_dataset_that_cannot_load_in_the_helpers_raises_its_own_error_every_time(
    tmp_path: Any,
) -> None:
    """Three zygote helpers fail to load the dataset and exit; tasks sent before their news was
    read meet a closed pipe. The loop gets the dataset's error, not "exited unexpectedly"; with
    persistent workers too, at every epoch, not "this iterator was closed"."""
    out = _run(
        tmp_path,
        """
        class FailsToLoad(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return i

            def __getstate__(self):
                return {}

            def __setstate__(self, state):
                raise ValueError("cannot load this dataset here")

        ThreadDataLoader(Rows(), num_workers=1, isolation="process")  # the zygote forks here
        raised = []
        with another_thread():
            for _ in range(6):
                iso = ThreadDataLoader(FailsToLoad(), batch_size=2, num_workers=3,
                                       isolation="process", helpers=3, timeout=30)
                try:
                    list(iso)
                except Exception as exc:
                    raised.append(type(exc).__name__)
            # persistent: each iter() starts new helpers, as the epoch that lost its own ended
            iso = ThreadDataLoader(FailsToLoad(), batch_size=2, num_workers=2, timeout=30,
                                   isolation="process", helpers=2, persistent_workers=True)
            for _ in range(3):
                try:
                    list(iso)
                except Exception as exc:
                    raised.append(type(exc).__name__)
        print(*raised)
        """,
    )
    assert out == ["ValueError"] * 9


def test_a_dataset_class_the_script_redefines_reaches_helpers_from_a_new_zygote(
    tmp_path: Any,
) -> None:
    """The script redefines its dataset's class after the zygote's fork (a notebook cell run
    again): the zygote's ``__main__`` holds the old class. Building a loader on the new one,
    while the script runs one thread, forks a new zygote; helpers forked from it while another
    thread runs run the new class's code. The old zygote, with no helper left, exits."""
    out = _run(
        tmp_path,
        """
        class Tens(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return i

        first = ThreadDataLoader(Tens(), batch_size=2, num_workers=2, isolation="process")
        old = zygote.server_pid()
        with another_thread():
            print("old", [b.tolist() for b in first])

        class Tens(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return i * 10

        iso = ThreadDataLoader(Tens(), batch_size=2, num_workers=2, isolation="process")
        with another_thread():
            it = iter(iso)
            print("parents", parents(it) == {zygote.server_pid()}, zygote.server_pid() != old)
            print("new", [b.tolist() for b in it])
        deadline = time.monotonic() + 10
        while zygote.retired_pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("retired", zygote.retired_pids(), psutil.pid_exists(old))
        """,
    )
    assert out == [
        "old", "[[0,", "1],", "[2,", "3]]", "parents", "True", "True",
        "new", "[[0,", "10],", "[20,", "30]]", "retired", "[]", "False",
    ]  # fmt: skip


def test_a_retired_zygote_serves_its_persistent_helpers_until_they_end(tmp_path: Any) -> None:
    """A persistent loader's helpers come from a zygote that a later class retires: they go on
    serving epochs, report a clean exit when the loader ends, and the old zygote exits then."""
    out = _run(
        tmp_path,
        """
        first = loader(isolation="process", persistent_workers=True)
        threads = loader(persistent_workers=True)
        expected = [list(threads), list(threads)]
        del threads  # its worker threads end: this process runs one thread again
        old = zygote.server_pid()
        with another_thread():
            print("first", same(list(first), expected[0]))

        class Later(torch.utils.data.Dataset):
            def __len__(self):
                return 2

            def __getitem__(self, i):
                return i + 100

        later = ThreadDataLoader(Later(), batch_size=2, num_workers=1, isolation="process")
        print("replaced", zygote.server_pid() != old, zygote.retired_pids() == [old])
        with another_thread():
            print("later", [b.tolist() for b in later])
            print("again", same(list(first), expected[1]))
            processes = list(first._iterator._links.links)
            del first
            print("codes", [p.process.exitcode for p in processes])
        deadline = time.monotonic() + 10
        while psutil.pid_exists(old) and time.monotonic() < deadline:
            zygote.may_fork()  # as any iter() asks: a retired zygote that exited is reaped
            time.sleep(0.01)
        print("retired", psutil.pid_exists(old), zygote.retired_pids())
        """,
    )
    assert out == [
        "first", "True", "replaced", "True", "True", "later", "[[100,", "101]]",
        "again", "True", "codes", "[0]", "retired", "False", "[]",
    ]  # fmt: skip


def test_a_class_defined_after_the_zygote_forked_comes_to_helpers_from_the_forkserver(
    tmp_path: Any,
) -> None:
    """A loader built at the script's top level forks the zygote before the script defines a
    class; built while another thread runs, a loader on that class cannot fork a new zygote:
    its helpers come from the forkserver, which imports the script and finds the class."""
    source = _PRELUDE + textwrap.dedent(
        """
            FIRST = loader(isolation="process")  # the zygote forks here, in the training process


            class Later(torch.utils.data.Dataset):
                def __len__(self):
                    return 4

                def __getitem__(self, i):
                    return i * 10


            if __name__ == "__main__":
                with another_thread():
                    iso = ThreadDataLoader(Later(), batch_size=2, num_workers=2,
                                           isolation="process", timeout=60)
                    it = iter(iso)
                    print("zygote", zygote.server_pid() in parents(it))
                    print("batches", [b.tolist() for b in it])
            """
    )
    done = _run_script(tmp_path, source)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["zygote", "False", "batches", "[[0,", "10],", "[20,", "30]]"]


def test_a_method_or_cached_function_the_script_replaced_reaches_helpers_from_a_new_zygote(
    tmp_path: Any,
) -> None:
    """After the zygote's fork the script replaces a method on its dataset's class, then
    redefines an ``lru_cache``-wrapped function the dataset's code calls: building a loader
    after each forks a new zygote, whose helpers run both as the training process does."""
    out = _run(
        tmp_path,
        """
        import functools

        @functools.lru_cache(maxsize=None)
        def offset(i):
            return 0

        class Patched(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return i + offset(i)

        ThreadDataLoader(Patched(), num_workers=1, isolation="process")  # the zygote forks here
        first = zygote.server_pid()
        Patched.__getitem__ = lambda self, i: i * 10 + offset(i)
        iso = ThreadDataLoader(Patched(), batch_size=2, num_workers=2, isolation="process")
        second = zygote.server_pid()

        @functools.lru_cache(maxsize=None)
        def offset(i):
            return 1

        again = ThreadDataLoader(Patched(), batch_size=2, num_workers=2, isolation="process")
        print("forked", len({first, second, zygote.server_pid()}))
        with another_thread():
            for name, each in (("patched", iso), ("cached", again)):
                it = iter(each)
                print(name, parents(it) == {zygote.server_pid()}, [b.tolist() for b in it])
        """,
    )
    assert out == [
        "forked", "3",
        "patched", "True", "[[1,", "11],", "[21,", "31]]",
        "cached", "True", "[[1,", "11],", "[21,", "31]]",
    ]  # fmt: skip


def test_a_changed_class_deeper_than_the_walk_keeps_helpers_off_the_stale_zygote(
    tmp_path: Any,
) -> None:
    """A transform class the script defined after a top-level loader forked the zygote sits
    deeper in the dataset than the walk of its code looks (``Subset`` of a dataset holding a
    ``Compose``-like list): the helper's pickle names it, so the helpers come from the
    forkserver, which imports the script and finds it, with a warning."""
    source = _PRELUDE + textwrap.dedent(
        """
            class Compose:
                def __init__(self, steps):
                    self.steps = steps

                def __call__(self, x):
                    for step in self.steps:
                        x = step(x)
                    return x


            class Transformed(torch.utils.data.Dataset):
                def __init__(self, transform):
                    self.transform = transform

                def __len__(self):
                    return 4

                def __getitem__(self, i):
                    return self.transform(i)


            FIRST = loader(isolation="process")  # the zygote forks here, in the training process


            class Scale:
                def __call__(self, x):
                    return x * 10


            if __name__ == "__main__":
                dataset = torch.utils.data.Subset(Transformed(Compose([Scale()])), range(4))
                with another_thread():
                    iso = ThreadDataLoader(dataset, batch_size=2, num_workers=2,
                                           isolation="process", timeout=60)
                    it = iter(iso)
                    print("zygote", zygote.server_pid() in parents(it))
                    print("batches", [b.tolist() for b in it])
            """
    )
    done = _run_script(tmp_path, source)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["zygote", "False", "batches", "[[0,", "10],", "[20,", "30]]"]
    assert "RuntimeWarning: threadloader: Scale, defined in __main__, changed" in done.stderr


def test_a_loader_built_after_the_script_changed_its_code_replaces_the_zygote(
    tmp_path: Any,
) -> None:
    """Building a loader while only the main thread runs replaces a zygote whose copy of the
    script's code is out of date: with ``isolation="process"`` also for a class its dataset
    does not use (each later start would check its whole pickle otherwise), and with the
    default ``"auto"``, which starts no zygote, one that lacks its dataset's class."""
    out = _run(
        tmp_path,
        """
        ThreadDataLoader(Rows(), num_workers=1, isolation="process")  # the zygote forks here
        first = zygote.server_pid()

        class Model(torch.nn.Module):  # unused by any dataset
            pass

        ThreadDataLoader(Rows(), num_workers=1, isolation="process")
        second = zygote.server_pid()
        print("unrelated", second != first, zygote._server.script.changed(zygote._Script()))

        class Rows(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return i * 10

        auto = ThreadDataLoader(Rows(), batch_size=2, num_workers=2)
        print("auto", zygote.server_pid() not in (first, second, None))
        """,
    )
    assert out == ["unrelated", "True", "frozenset()", "auto", "True"]


def test_class_attributes_changed_since_the_fork_reach_the_zygotes_helpers(tmp_path: Any) -> None:
    """After the zygote's fork a dataset class counted its reads and opened a lock into class
    attributes, and the script set its base class's attribute, deleted the class's own and set
    a nested class's: data, not code. The helpers still come from the zygote, with no warning,
    and read the values as the training process has them (the lock, which cannot be pickled,
    they open themselves), as worker threads and torch's fork-started workers do."""
    out = _run(
        tmp_path,
        """
        import warnings

        import threading

        class Base(torch.utils.data.Dataset):
            scale = 1

        class Scaled(Base):
            reads, handle, scale = 0, None, 2

            class Offset:
                value = 0

            def __len__(self):
                return 4

            def __getitem__(self, i):
                Scaled.reads += 1
                if Scaled.handle is None:  # opened on first use; cannot be pickled
                    Scaled.handle = threading.Lock()
                return i * self.scale + Scaled.Offset.value

        class Cache:
            table = torch.zeros(1000)

        iso = ThreadDataLoader(Scaled(), batch_size=2, num_workers=2, isolation="process")
        print("threads", len(list(ThreadDataLoader(Scaled(), num_workers=2))), Scaled.reads)
        import gc, weakref
        table, Cache.table = weakref.ref(Cache.table), None  # the zygote's record keeps it not
        gc.collect()
        print("freed", table() is None)
        Base.scale = 10  # on the base class, which the dataset's code never names
        del Scaled.scale  # so that the base's is read
        Scaled.Offset.value = 1  # on a nested class
        with another_thread(), warnings.catch_warnings():
            warnings.simplefilter("error")
            it = iter(iso)
            print("zygote", parents(it) == {zygote.server_pid()}, [b.tolist() for b in it])
        """,
    )
    assert out == [
        "threads", "4", "4", "freed", "True", "zygote", "True", "[[1,", "11],", "[21,", "31]]",
    ]  # fmt: skip


def test_class_attributes_changed_in_place_since_the_fork_reach_the_zygotes_helpers(
    tmp_path: Any,
) -> None:
    """After the zygote's fork the script filled a class-level dict and list and added to a
    class-level tensor in place: the same objects, changed. The zygote's helpers read them as
    the training process has them (torch's fork-started workers do), and a constant attribute
    left as it was stays the zygote's."""
    out = _run(
        tmp_path,
        """
        import numpy as np

        class Vocab(torch.utils.data.Dataset):
            words, order, weights, name = {}, [], torch.zeros(4), "v"
            offsets = np.zeros(4)

            def __len__(self):
                return 4

            def __getitem__(self, i):
                found = Vocab.words.get(i, -1) + len(Vocab.order) + int(Vocab.offsets[i])
                return found + int(Vocab.weights[i])

        iso = ThreadDataLoader(Vocab(), batch_size=2, num_workers=2, isolation="process")
        Vocab.words.update({0: 0, 1: 10, 2: 20, 3: 30})
        Vocab.order.append("x")
        Vocab.weights.data.add_(50)  # torch does not count this change: the bytes tell it
        Vocab.offsets[:] = 50
        print_zygote_epoch(iso)
        """,
    )
    assert out == ["zygote", "True", "[[101,", "111],", "[121,", "131]]"]


def test_a_library_callable_the_script_set_on_a_class_reaches_the_zygotes_helpers(
    tmp_path: Any,
) -> None:
    """After the zygote's fork the script set a class attribute to a library's callable object
    (a tokenizer, a module: here an ``itemgetter``), which pickle sends by value: data, not the
    script's code. With another thread running (no new zygote can fork) the helpers still come
    from the zygote, with no warning, and call the new object."""
    out = _run(
        tmp_path,
        """
        import operator, warnings

        class Pick(torch.utils.data.Dataset):
            pick = operator.itemgetter(0)

            def __len__(self):
                return 4

            def __getitem__(self, i):
                return Pick.pick((i, i * 10))

        iso = ThreadDataLoader(Pick(), batch_size=2, num_workers=2, isolation="process")
        Pick.pick = operator.itemgetter(1)
        with another_thread(), warnings.catch_warnings():
            warnings.simplefilter("error")
            it = iter(iso)
            print("zygote", parents(it) == {zygote.server_pid()}, [b.tolist() for b in it])
        """,
    )
    assert out == ["zygote", "True", "[[0,", "10],", "[20,", "30]]"]


def test_a_class_attribute_too_large_to_send_is_named_in_the_warning(tmp_path: Any) -> None:
    """A class-level tensor changed in place beyond what a start may send: the helpers cannot
    receive it, and ``isolation="process"`` warns naming it, as it does for such a global."""
    out = _run(
        tmp_path,
        """
        import warnings
        from threadloader.isolation import main_state

        main_state.LIMIT_BYTES = 4096

        class Table(torch.utils.data.Dataset):
            table = torch.zeros(4096)

            def __len__(self):
                return 4

            def __getitem__(self, i):
                return int(Table.table[i])

        iso = ThreadDataLoader(Table(), batch_size=2, num_workers=2, isolation="process")
        Table.table += 1
        with another_thread(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = [b.tolist() for b in iso]
        print("warned", any("Table.table" in str(w.message) for w in caught), batches)
        """,
    )
    assert out == ["warned", "True", "[[0,", "0],", "[0,", "0]]"]


def test_instances_of_script_classes_set_on_a_class_reach_the_zygotes_helpers(
    tmp_path: Any,
) -> None:
    """After the zygote's fork the script set a config object of its own class on the dataset's
    class, and changed another one in place: the zygote's helpers read both as the training
    process has them, while a sentinel left as it was stays the very object their code
    compares with ``is``."""
    out = _run(
        tmp_path,
        """
        class Config:
            def __init__(self, scale):
                self.scale = scale

        class Missing:
            pass

        MISSING = Missing()

        class Scaled(torch.utils.data.Dataset):
            config, tuning, cache = Config(1), Config(0), MISSING

            def __len__(self):
                return 4

            def __getitem__(self, i):
                unset = Scaled.cache is MISSING
                return i * Scaled.config.scale + Scaled.tuning.scale + (100 if unset else 0)

        iso = ThreadDataLoader(Scaled(), batch_size=2, num_workers=2, isolation="process")
        Scaled.config = Config(10)
        Scaled.tuning.scale = 1
        print_zygote_epoch(iso)
        """,
    )
    assert out == ["zygote", "True", "[[101,", "111],", "[121,", "131]]"]


def test_a_callable_object_and_a_rebound_function_global_reach_the_zygotes_helpers(
    tmp_path: Any,
) -> None:
    """After the zygote's fork the script changed a transform object of its own class held by
    the dataset's class in place, and rebound a global the items call to another function:
    the zygote's helpers run both as the training process has them."""
    out = _run(
        tmp_path,
        """
        class Times:
            def __init__(self, k):
                self.k = k

            def __call__(self, x):
                return x * self.k

        def same(x):
            return x

        def negate(x):
            return -x

        SIGN = same

        class Transformed(torch.utils.data.Dataset):
            transform = Times(1)

            def __len__(self):
                return 4

            def __getitem__(self, i):
                return SIGN(Transformed.transform(i))

        iso = ThreadDataLoader(Transformed(), batch_size=2, num_workers=2, isolation="process")
        Transformed.transform.k = 10
        SIGN = negate
        print_zygote_epoch(iso)
        """,
    )
    assert out == ["zygote", "True", "[[0,", "-10],", "[-20,", "-30]]"]


def test_a_class_reached_through_a_default_argument_reaches_the_zygotes_helpers(
    tmp_path: Any,
) -> None:
    """The items call a function whose default argument is a class of the script, whose
    attribute the script set after the zygote's fork: the helpers read it as set."""
    out = _run(
        tmp_path,
        """
        class Table:
            scale = 1

        def scaled(x, table=Table):
            return x * table.scale

        class ViaDefault(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return scaled(i)

        iso = ThreadDataLoader(ViaDefault(), batch_size=2, num_workers=2, isolation="process")
        Table.scale = 7
        print_zygote_epoch(iso)
        """,
    )
    assert out == ["zygote", "True", "[[0,", "7],", "[14,", "21]]"]


def test_a_large_class_level_table_nobody_changed_is_not_sent_and_one_changed_is_named(
    tmp_path: Any,
) -> None:
    """Class-level tables beyond what a start may send: left as the zygote has them, with no
    warning, while their checksums say nothing changed them; once one changed in place (a
    tensor, a dict), the helpers cannot receive it and ``isolation="process"`` names it."""
    out = _run(
        tmp_path,
        """
        import warnings
        from threadloader.isolation import main_state

        main_state.LIMIT_BYTES = 4096

        class Table(torch.utils.data.Dataset):
            names = {i: str(i) for i in range(2000)}
            weights = torch.zeros(4096)

            def __len__(self):
                return 4

            def __getitem__(self, i):
                return int(Table.names[i]) + int(Table.weights[i])

        iso = ThreadDataLoader(Table(), batch_size=2, num_workers=2, isolation="process")
        with another_thread(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = [b.tolist() for b in iso]
        print("quiet", not caught, batches)
        Table.weights += 1
        Table.names[0] = "5"
        with another_thread(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = [b.tolist() for b in iso]
        text = " ".join(str(w.message) for w in caught)
        print("named", "Table.weights" in text, "Table.names" in text)
        """,
    )
    assert out == ["quiet", "True", "[[0,", "1],", "[2,", "3]]", "named", "True", "True"]
