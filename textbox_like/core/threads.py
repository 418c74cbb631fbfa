"""Starting helper threads in a process whose signal handlers raise."""
import signal
import threading


def start_thread(thread: threading.Thread) -> threading.Thread:
    """Start ``thread`` with the signals that have Python handlers held back
    until it runs, and return it.

    Why: CPython's ``Thread.start`` undoes its bookkeeping if an exception is
    raised just after the new thread was created; a handler that raises (our
    SIGTERM/SIGINT handlers do, to stop start-up at once) can land exactly
    there, and the new thread then dies with a ``KeyError`` traceback on
    stderr. Held signals stay pending and are handled as soon as the mask is
    restored, in the main thread; the new thread keeps them blocked, so the
    kernel never delivers them to it."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no masks, and no such race reported
        thread.start()
        return thread
    handled = {number for number in signal.valid_signals()
               if number not in (signal.SIGKILL, signal.SIGSTOP) and callable(signal.getsignal(number))}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread
