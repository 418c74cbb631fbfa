"""Python processes the suite starts, forked from a process that has imported torch already.

The slow tier starts some 400 Python processes (a trainer's command line, a plan's rank processes, a search, a
launcher), each paying ~3 CPU-s for torch's import before it does the ~0.2 s of training a test asks of it. A
*zygote*, one per pytest process, imports torch (and torch.distributed, numpy) once; a ``subprocess.Popen`` of
``[sys.executable, ...]`` is then a fork of it, set up as a fresh interpreter would be:

- its stdin, stdout and stderr the Popen's (passed over a Unix socket), everything else closed;
- its working directory, environment, argv and sys.path (``-c``, ``-m``, a script; ``PYTHONPATH``; ``-u``,
  ``-B``), stdio objects (unbuffered under ``-u``/``PYTHONUNBUFFERED``), a fresh random state;
- signals as an exec'd interpreter has them: those this process ignores stay ignored, the others default, SIGINT
  Python's KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored; its own session or process group where asked;
- at its end, what the interpreter does: non-daemon threads joined, atexit run, stdio flushed, the exit code
  of SystemExit, an uncaught exception printed (code 1), an uncaught KeyboardInterrupt ended by SIGINT;
- coverage started in it where ``COVERAGE_PROCESS_START`` asks (as coverage's .pth would).

It is a real process: its pid takes signals, its group can be killed, it opens files and ports, it is killed
as a node dies. The zygote reaps it and reports its exit status, which the Popen's poll and wait read. Nothing
of ours is imported in the zygote (a module that reads the environment at import reads the child's), and a
Popen it cannot serve exactly (a shell, preexec_fn, pass_fds, another interpreter, options other than -c, -m,
-u, -B, an environment that changes what torch read at import: LD_*, MALLOC_*, TORCH* ...) starts as
before. ``TEXTBOX_LIKE_TEST_ZYGOTE=0`` turns it off.

Two flavours, each its own zygote, started at its first use:

- ``torch``: numpy, torch, torch.distributed: every child but those below (not torch._dynamo: that a one-process
  run never loads it is tested);
- ``hf``: that and transformers (its model and tokenizer modules, GPT-2, BART, BERT), datasets, accelerate and
  peft, whose import costs a ``--task hf`` child ~5 CPU-s more than torch's: a child whose command line names
  ``hf``, ``peft``, ``transformers`` or ``model_name_or_path``. Those libraries read the Hugging Face
  variables (HF_*, TRANSFORMERS_*, HOME, XDG_*...) at import: a child whose environment changes one of them
  starts by exec.

A thread count in OMP_NUM_THREADS / MKL_NUM_THREADS (a positive number, the trials' and benchmarks' one
thread) is what ``torch.set_num_threads`` sets in the child: the zygote has run no parallel region, so its
OpenMP pool is still unmade, and the child's is made at that count as an exec'd one's would be.
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading

#: variables whose value the zygote's imports already read: a child whose environment changes one starts as before
UNSAFE_PREFIXES = ("LD_", "MALLOC_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "TORCH", "PYTORCH", "CUDA",
                   "GLIBC_", "LC_", "LANG", "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONWARNINGS", "PYTHONHOME",
                   "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONIOENCODING", "PYTHONDEVMODE",
                   "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME", "PYTHONUTF8", "PYTHONINSPECT", "PYTHONOPTIMIZE",
                   "PYTHONVERBOSE", "PYTHONSTARTUP", "PYTHONPLATLIBDIR", "PYTHONEXECUTABLE")
#: what the hf zygote's libraries also read at import (their caches, offline modes, verbosity, backends)
HF_UNSAFE_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "ACCELERATE", "PEFT", "TOKENIZERS",
                      "SAFETENSORS", "HOME", "XDG_", "USE_TORCH", "USE_TF", "USE_JAX", "USE_FLAX", "TQDM",
                      "DISABLE_", "TRUST_REMOTE_CODE", "BITSANDBYTES", "WANDB", "MLFLOW", "COMET", "NEPTUNE")
#: read where they are used, never at import: a child may change them (a test's torchrun nodes; an in-process
#: prepare_bert publishes TOKENIZERS_PARALLELISM, and every later hf child was refused)
READ_WHEN_USED = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TOKENIZERS_PARALLELISM")
#: the thread counts a child may set (torch.set_num_threads in it)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: what each flavour's zygote imports before it forks. torch._dynamo (2.3 CPU-s to import) is imported by every
#: rank of two or more (DDP's constructor), every --fsdp and every --compile run; a one-process run does not
#: import it (textbox_like.core.internals), and with it loaded runs torch's own code instead, bitwise the same
#: (tests/integration/test_internals_processes.py holds both, in a fresh interpreter)
FLAVOURS = {"torch": ("numpy", "torch", "torch.distributed", "torch._dynamo"),
            "hf": ("numpy", "torch", "torch.distributed", "torch._dynamo", "transformers", "transformers.modeling_utils",
                   "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
                   "transformers.models.gpt2.modeling_gpt2", "transformers.models.bart.modeling_bart",
                   "transformers.models.bert.modeling_bert", "datasets", "accelerate", "peft")}

ZYGOTE_SCRIPT = r'''
import json, os, select, signal, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
signal.signal(signal.SIGINT, signal.SIG_IGN)   # pytest's Ctrl-C is pytest's; the zygote ends with its socket
import importlib
for name in sys.argv[2].split(","):   # the flavour's modules: what its children would import first
    importlib.import_module(name)
import numpy, torch   # noqa: E401
own_path = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
BASE_PATH = [p for p in sys.path[1:] if os.path.abspath(p) not in own_path]


def child(req, fds, ready):
    import builtins, io, random, runpy, threading, traceback, types
    sock.close()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.closerange(3, ready)
    os.closerange(ready + 1, 65536)
    try:   # as Popen's child before its exec: a failure here is the Popen's OSError
        if req["new_session"]:
            os.setsid()
        elif req["process_group"] >= 0:
            os.setpgid(0, req["process_group"])
        os.chdir(req["cwd"])
    except OSError as exc:
        os.write(ready, str(exc.errno).encode())
        os._exit(255)
    os.close(ready)   # set up: the Popen returns (its exec would have succeeded here)
    os.environ.clear()
    os.environ.update(req["env"])
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if sig in req["ignored"] else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    if signal.SIGINT not in req["ignored"]:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    random.seed()
    numpy.random.seed()
    if req["threads"]:
        torch.set_num_threads(req["threads"])
    env = req["env"]
    unbuffered = "-u" in req["opts"] or bool(env.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = "-B" in req["opts"] or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    def stream(fd, mode, errors):
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "r":
            return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors=errors)
        tty = os.isatty(fd)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                                line_buffering=tty, write_through=unbuffered)
    sys.stdin = sys.__stdin__ = stream(0, "r", "strict")
    sys.stdout = sys.__stdout__ = stream(1, "w", "strict")
    sys.stderr = sys.__stderr__ = stream(2, "w", "backslashreplace")
    import faulthandler
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr)
    else:
        faulthandler.disable()
    kind, target = req["kind"], req["target"]
    first = {"c": "", "m": req["cwd"], "path": os.path.dirname(os.path.abspath(target))}[kind]
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *BASE_PATH]
    sys.argv[:] = list(req["argv"])
    sys.orig_argv[:] = list(req["args"])
    import importlib.util
    sys.modules.pop("sitecustomize", None)   # site's import at start, from this process's path
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            import sitecustomize   # noqa: F401
    except Exception:
        traceback.print_exc()
    if env.get("COVERAGE_PROCESS_START") or env.get("COVERAGE_PROCESS_CONFIG"):
        try:
            import coverage
            coverage.process_startup()
        except Exception:
            pass
    code, interrupted = 0, False
    try:
        if kind == "c":
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        elif kind == "m":
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
    except BaseException:
        pass
    try:
        import atexit
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        pass
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except BaseException:
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    try:
        print(exc.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


children = set()
while True:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            break
        if pid == 0:
            break
        children.discard(pid)
        sock.send(json.dumps({"exit": pid, "status": status}).encode())
    ready, _, _ = select.select([sock], [], [], 0.005 if children else 1.0)
    if not ready:
        continue
    try:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 22, 3)
    except OSError:
        break
    if not message:
        break
    req = json.loads(message)
    readable, ready = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(readable)
            child(req, fds, ready)
        finally:
            os._exit(121)
    os.close(ready)
    for fd in fds:
        os.close(fd)
    failed = b""
    while True:
        part = os.read(readable, 64)
        if not part:
            break
        failed += part
    os.close(readable)
    if failed:
        os.waitpid(pid, 0)
        sock.send(json.dumps({"pid": pid, "errno": int(failed)}).encode())
        continue
    children.add(pid)
    sock.send(json.dumps({"pid": pid}).encode())
'''


class Zygote:
    """The forking process of this pytest process, and what it reports."""

    def __init__(self, flavour):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        self.proc = _REAL_POPEN([sys.executable, "-c", ZYGOTE_SCRIPT, str(theirs.fileno()), ",".join(FLAVOURS[flavour])],
                                pass_fds=(theirs.fileno(),),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True, env=zygote_env())
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.replies = queue.Queue()
        self.exits = {}
        self.changed = threading.Condition()
        self.alive = True
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self):
        while True:
            try:
                message = self.sock.recv(1 << 16)
            except OSError:
                message = b""
            if not message:
                with self.changed:
                    self.alive = False
                    self.changed.notify_all()
                self.replies.put(None)
                return
            record = json.loads(message)
            if "pid" in record:
                self.replies.put(record)
            else:
                with self.changed:
                    self.exits[record["exit"]] = record["status"]
                    self.changed.notify_all()

    def spawn(self, request, fds) -> int:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            reply = self.replies.get(timeout=60)
        if reply is None:
            raise OSError("the zygote is gone")
        if "errno" in reply:   # as Popen raises what failed in its child before the exec
            raise OSError(reply["errno"], os.strerror(reply["errno"]), request["cwd"])
        return reply["pid"]

    def status(self, pid, timeout=None):
        """The raw exit status of child ``pid``: at once (timeout 0), within ``timeout`` s, or None."""
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while pid not in self.exits:
                if not self.alive:
                    return 255 << 8   # the zygote died: its children are orphans we cannot wait for
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.changed.wait(left)
            return self.exits.pop(pid)

    def close(self):
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_REAL_POPEN = subprocess.Popen
_ZYGOTES = {}
_ZYGOTES_PID = None


def zygote(flavour):
    """This process's zygote of ``flavour`` (started at its first use; a forked pytest helper gets its own)."""
    global _ZYGOTES, _ZYGOTES_PID
    if _ZYGOTES_PID != os.getpid():
        _ZYGOTES, _ZYGOTES_PID = {}, os.getpid()
    if flavour not in _ZYGOTES:
        _ZYGOTES[flavour] = Zygote(flavour)
    return _ZYGOTES[flavour] if _ZYGOTES[flavour].alive else None


def flavour_of(args) -> str:
    """``hf`` for a child whose command line names the Hugging Face side, else ``torch``."""
    line = " ".join(args)
    return "hf" if set(re.findall(r"[A-Za-z_]+", line)) & {"hf", "peft", "transformers", "model_name_or_path"} or \
        "model-name-or-path" in line else "torch"


def refused(args, why):
    """None (the child starts by exec), and why in $TEXTBOX_LIKE_TEST_ZYGOTE_LOG where set: the list of what
    the zygote could not serve, to keep it serving what it can."""
    log = os.environ.get("TEXTBOX_LIKE_TEST_ZYGOTE_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{why}\t{' '.join(map(str, args if isinstance(args, (list, tuple)) else [args]))[:300]}\n")
    return None


def request_for(args, executable, shell, preexec_fn, pass_fds, cwd, env, gid, gids, uid, umask, close_fds,
                start_new_session, process_group):
    """What the zygote needs to start ``args`` as a fresh interpreter would, or None where it cannot."""
    if shell or preexec_fn is not None or pass_fds or uid is not None or gid is not None or gids is not None \
            or umask != -1 or not close_fds or isinstance(args, (str, bytes)):
        return refused(args, "shell, preexec_fn, pass_fds, ids, umask, close_fds=False or a string command")
    args = [os.fsdecode(a) if isinstance(a, bytes) else os.fspath(a) for a in args]
    if not args or args[0] != sys.executable or executable not in (None, sys.executable):
        return refused(args, "not this interpreter")
    opts, i = [], 1
    while i < len(args) and args[i] in ("-u", "-B"):
        opts.append(args[i])
        i += 1
    if i >= len(args):
        return refused(args, "no program")
    if args[i] in ("-c", "-m"):
        if i + 1 >= len(args):
            return refused(args, "no program")
        kind, target = args[i][1], args[i + 1]
        argv = (["-c"] if kind == "c" else [target]) + args[i + 2:]
    elif args[i].startswith("-"):
        return refused(args, f"interpreter option {args[i]}")
    else:
        kind, target, argv = "path", args[i], args[i:]
    env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
    base = zygote_env()
    flavour = flavour_of(args)
    unsafe = UNSAFE_PREFIXES + (HF_UNSAFE_PREFIXES if flavour == "hf" else ())
    counts = {env.get(key) for key in THREAD_VARIABLES if env.get(key) != base.get(key)}
    threads = None
    if counts:
        given = [env[key] for key in THREAD_VARIABLES if key in env]
        if len(set(given)) != 1 or not given[0].isdigit() or int(given[0]) < 1:
            return refused(args, f"thread counts {[env.get(key) for key in THREAD_VARIABLES]}")
        threads = int(given[0])
    for key in set(env) | set(base):
        if key.startswith(unsafe) and key not in THREAD_VARIABLES + READ_WHEN_USED and env.get(key) != base.get(key):
            return refused(args, f"environment {key}={env.get(key)!r}, the zygote's {base.get(key)!r}")
    ignored = [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
               and signal.getsignal(s) == signal.SIG_IGN]
    return {"kind": kind, "target": target, "argv": argv, "opts": opts, "args": args, "flavour": flavour,
            "threads": threads,
            "cwd": os.path.abspath(os.fspath(cwd)) if cwd else os.getcwd(), "env": env,
            "new_session": bool(start_new_session), "process_group": -1 if process_group in (None, -1)
            else int(process_group), "ignored": ignored}


_BASE_ENV = None


def zygote_env() -> dict:
    global _BASE_ENV
    if _BASE_ENV is None:
        _BASE_ENV = dict(os.environ)
    return _BASE_ENV


class ZygotePopen(_REAL_POPEN):
    """subprocess.Popen, served by the zygote where it can be (see the module's doc)."""

    _zygote = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        request = None
        if os.environ.get("TEXTBOX_LIKE_TEST_ZYGOTE", "1") == "0":
            refused(args, "TEXTBOX_LIKE_TEST_ZYGOTE=0 (a fresh_interpreter test)")
        elif subprocess._fork_exec is not _REAL_FORK_EXEC:
            refused(args, "subprocess._fork_exec is replaced")
        else:
            request = request_for(args, executable, shell, preexec_fn, pass_fds, cwd, env, gid, gids, uid, umask,
                                  close_fds, start_new_session, process_group)
        server = zygote(request["flavour"]) if request is not None else None
        if request is not None and server is None:
            refused(args, "no zygote in this process")
        if server is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                                          process_group)
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        self.pid = server.spawn(request, fds)
        self._zygote = server
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._zygote is None:
            return super()._internal_poll(_deadstate=_deadstate, **kwargs)
        if self.returncode is None:
            status = self._zygote.status(self.pid, 0)
            if status is not None:
                self._handle_exitstatus(status)
        return self.returncode

    def _wait(self, timeout):
        if self._zygote is None:
            return super()._wait(timeout)
        if self.returncode is None:
            status = self._zygote.status(self.pid, timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._handle_exitstatus(status)
        return self.returncode


_REAL_FORK_EXEC = subprocess._fork_exec


def install():
    """subprocess.Popen (and run, check_output, call: they use it) served by the zygote from now on."""
    zygote_env()
    subprocess.Popen = ZygotePopen


def uninstall():
    subprocess.Popen = _REAL_POPEN
    if _ZYGOTES_PID == os.getpid():
        for server in _ZYGOTES.values():
            server.close()
