"""Console hygiene shared by our entry points (CPU trainer, verl entry, verl agent-loop workers):
HTTP and file-lock libraries log one INFO line per request or lock, which buries progress bars."""
import logging

QUIET_LOGGERS = ("httpx", "httpcore", "urllib3", "filelock", "fsspec")


def quiet_library_loggers() -> None:
    """Set the chatty library loggers to WARNING (call after Hydra's logging setup, which resets them)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
