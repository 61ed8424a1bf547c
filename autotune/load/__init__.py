"""Load: drive a recorded schedule against a server and record every request.

The load generator (open or closed loop: a driver each, ``_modes``; sessions replayed
turn by turn, ``_sessions``; a hash-id trace replayed exactly, ``_exact``; the hooks that watch
a run, ``_hooks``; a streaming OpenAI client on a pool of keep-alive HTTP/1.1
connections), the prompts built for the model's tokenizer, the server's ``/metrics``
client, and the small HTTP helper every other request uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.load._exact import (
        HashRequest,
        block_token_ids,
        exact_schedule,
        read_hash_trace,
    )
    from autotune.load._http1 import (
        Pool,
        RequestFailure,
        Target,
    )
    from autotune.load._http1 import (
        _Conn as _Conn,
    )
    from autotune.load._loadgen import (
        replay,
        run_schedule,
    )
    from autotune.load._prompts import (
        ModelPrompts,
        PromptError,
        build_prompts,
        model_prompts,
        model_vocab_size,
        text_prompts,
    )
    from autotune.load._prompts import (
        _prose as _prose,
    )
    from autotune.load._records import (
        ERROR_REASONS,
        Abort,
        RequestRecord,
        RunResult,
        clip_command,
        failure_abort,
        staggered,
    )
    from autotune.load._server_metrics import (
        ServerSnapshot,
        fetch_metrics_text,
        parse_metrics,
        scrape_metrics,
        snapshot_metrics,
    )
    from autotune.load._sessions import (
        Session,
        SessionLoop,
        SessionSchedule,
        Turn,
        next_send_at,
        session_horizon,
        session_schedule,
        steady_sessions,
    )
    from autotune.load._sse import (
        _SseParser as _SseParser,
    )

__all__ = [
    "ERROR_REASONS",
    "Abort",
    "HashRequest",
    "ModelPrompts",
    "Pool",
    "PromptError",
    "RequestFailure",
    "RequestRecord",
    "RunResult",
    "ServerSnapshot",
    "Session",
    "SessionLoop",
    "SessionSchedule",
    "Target",
    "Turn",
    "block_token_ids",
    "build_prompts",
    "clip_command",
    "exact_schedule",
    "failure_abort",
    "fetch_metrics_text",
    "model_prompts",
    "model_vocab_size",
    "next_send_at",
    "parse_metrics",
    "read_hash_trace",
    "replay",
    "run_schedule",
    "scrape_metrics",
    "session_horizon",
    "session_schedule",
    "snapshot_metrics",
    "staggered",
    "steady_sessions",
    "text_prompts",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.load._exact": ("HashRequest", "block_token_ids", "exact_schedule",
                             "read_hash_trace"),
    "autotune.load._http1": ("Pool", "RequestFailure", "Target", "_Conn"),
    "autotune.load._loadgen": ("replay", "run_schedule"),
    "autotune.load._prompts": (
        "ModelPrompts",
        "PromptError",
        "_prose",
        "build_prompts",
        "model_prompts",
        "model_vocab_size",
        "text_prompts",
    ),
    "autotune.load._records": (
        "Abort",
        "ERROR_REASONS",
        "RequestRecord",
        "RunResult",
        "clip_command",
        "failure_abort",
        "staggered",
    ),
    "autotune.load._server_metrics": (
        "ServerSnapshot",
        "fetch_metrics_text",
        "parse_metrics",
        "scrape_metrics",
        "snapshot_metrics",
    ),
    "autotune.load._sessions": ("Session", "SessionLoop", "SessionSchedule", "Turn",
                                "next_send_at", "session_horizon", "session_schedule",
                                "steady_sessions"),
    "autotune.load._sse": ("_SseParser",),
})
