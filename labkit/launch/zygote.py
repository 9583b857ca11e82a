"""A warm parent for ranks: imports torch once, then forks a fresh rank per request.

Starting a rank the plain way (a new Python that imports torch) costs seconds on a small
machine, for every rank of every run. labkit.launch starts this process once per notebook
kernel (or test session), lazily (labkit.launch.warm), and asks it over a pipe to fork each rank:
a run then starts in a fraction of a second. It is started by path, not as a module, so nothing
of labkit but this file is imported before the fork, and the ranks see the current code. The zygote
dies with its parent (PR_SET_PDEATHSIG), and reaps its children, writing each one's exit status to
`exit<rank>` in the run's folder.

Protocol (stdin, one line per request): "<rundir> <rank>\n" -> stdout: "<pid>\n".
"""
import ctypes
import os
import signal
import sys


def _pdeathsig():
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_children = {}  # pid -> (rundir, rank)


def _reap(signum=None, frame=None):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        where = _children.pop(pid, None)
        if where:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            path = os.path.join(where[0], f"exit{where[1]}")
            try:
                with open(path + ".tmp", "w") as f:
                    f.write(str(code))
                os.replace(path + ".tmp", path)
            except OSError:
                pass  # the run's folder is gone: nobody is waiting for this status


def main():
    _pdeathsig()
    import cloudpickle  # noqa: F401 - warm imports, shared by every rank after fork
    import torch  # noqa: F401

    # torch.optim's first optimizer, and the first TorchDispatchMode, import torch._dynamo: 3-10 s
    # per rank on 2 busy cores, in every run that trains. Once here, every fork has it (no threads
    # are started by it: forking stays safe).
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    signal.signal(signal.SIGCHLD, _reap)
    # A notebook interrupt (or a kernel shutdown) signals the kernel's whole process group: the
    # zygote outlives it quietly; launch stops the ranks of an interrupted run itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer, sys.stdout
    stdout.write("ready\n")
    stdout.flush()
    while True:
        line = stdin.readline()
        if not line:
            return  # the parent closed the pipe
        rundir, rank = line.decode().split()
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # record the pid before reaping
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a rank as if started afresh
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            _pdeathsig()  # a fork clears it: die with the zygote
            _become_rank(rundir, int(rank))
            os._exit(1)  # not reached
        _children[pid] = (rundir, int(rank))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        stdout.write(f"{pid}\n")
        stdout.flush()


def _become_rank(rundir, rank):
    fd = os.open(os.path.join(rundir, f"out{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    sys.stdin = open(os.devnull)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    # here: the zygote forks before torch is imported; each child imports it
    from labkit.launch.rank import main as rank_main

    rank_main(rundir, rank, parent_pid=os.getppid())


if __name__ == "__main__":
    # Started by path: Python put this file's folder first on sys.path, where its sibling modules
    # would shadow top-level names; put the working folder there instead, as `python -m` would.
    sys.path[0] = os.getcwd()
    main()
