"""Every command's logging: fedbroker's own lines at the configured level, pika's kept out of the way.

pika logs every connect at INFO and every failed connect as six ERROR lines with a traceback; the bus says
the same in one line of its own (fedbroker.bus.amqp_problem). So unless the user asks for DEBUG, pika logs
at WARNING and its connect attempts not at all. `FEDBROKER__LOG_LEVEL=DEBUG` (or `log_level: DEBUG`) shows
everything pika says.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# pika's loggers whose records are connect attempts (each failure is one line of the bus's own)
CONNECT_LOGGERS = ("pika.adapters.utils.connection_workflow", "pika.adapters.utils.io_services_utils")
BLOCKING_LOGGER = "pika.adapters.blocking_connection"


class _NotConnectAttempts(logging.Filter):
    """Drops BlockingConnection's report of a failed connect (`Connection workflow failed`, and the same again
    with a traceback), keeping what it says about a connection that was up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.funcName != "_create_connection"


_FILTER = _NotConnectAttempts()


def setup_logging(level: str | int) -> None:
    """Log to stderr at `level` (a name or a number); pika quiet unless `level` is DEBUG."""
    number = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(number, int):
        number = logging.INFO
    logging.basicConfig(level=number, format=FORMAT)
    quiet_pika(debug=number <= logging.DEBUG)


def quiet_pika(*, debug: bool) -> None:
    """pika at WARNING and its connect attempts silent; with `debug`, pika as it is."""
    blocking = logging.getLogger(BLOCKING_LOGGER)
    if debug:
        logging.getLogger("pika").setLevel(logging.NOTSET)
        for name in CONNECT_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        blocking.removeFilter(_FILTER)
        return
    logging.getLogger("pika").setLevel(logging.WARNING)
    for name in CONNECT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    blocking.addFilter(_FILTER)
