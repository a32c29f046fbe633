"""The tool environment a run's tool calls meet, named by `config.sandbox.preset`.

Two presets:

- "release": the rStar2 release's environment (code-judge under the release's agent loop, spec §2.3
  and §3.2): a fresh interpreter per call, so importing numpy or sympy counts against the 4 s limit;
  256 + 128 MB of address space; stdout and stderr each cut to their first 1000 characters without
  stopping the program; the release wrapper's one-line errors ("ZeroDivisionError at line 3:
  division by zero\\n  print(1 / 0)"); observations middle-truncated to 256 characters (verl's
  max_tool_response_length); and the release agent loop's handling of malformed calls (arguments
  given as a JSON string are not run: "Error when executing tool: ...").
- "rich": this project's own environment: numpy, sympy and mpmath pre-imported (imports nearly
  free), 2048 MB, full tracebacks trimmed to the user's code, streams over 64 KiB kill the call,
  observations up to 4096 characters, and a parser that runs string-encoded arguments and names
  what is wrong with a call.

Each field below is a config field of the same name (`sandbox.*`, `rollout.observation_*`,
`rollout.tool_call_parsing`) whose None means "the preset's"; a value set explicitly wins.
`rstar_jax.config.resolve.tool_env` resolves them in one place; RL, evaluation and the synthetic SFT
data all take that one object, so the policy sees one environment from SFT to evaluation.
"""

from __future__ import annotations

import dataclasses
import math

from rstar_jax.agent.tool_calls import CALL_PARSING, OBSERVATION_STYLES

ERROR_FORMATS = ("traceback", "release")  # sandbox_service.harness
MAX_STREAM_CAP_CHARS = 1 << 20  # the sandbox's bound (sandbox_service.status)

PRESETS = {
    "release": {
        "timeout_s": 4.0,  # spec §3.2: MAX_EXECUTION_TIME=4 in the release's launch command
        # spec §3.2: code-judge's MAX_MEMORY 256 MB + 128 MB of interpreter overhead, as RLIMIT_AS on
        # the whole process: an allocation past it raises MemoryError (the wrapper's one line). The
        # worker a call forks from holds ~22 MB of address space where a fresh python3 holds ~14 MB,
        # so the room left differs by under 10 MB; importing numpy + sympy peaks at ~140 MB.
        "memory_mb": 384,
        "memory_address_space": True,
        "stream_cap_chars": 1000,  # spec §2.3 item 8: code-judge's MAX_STDOUT_ERROR_LENGTH
        "error_format": "release",  # spec §2.3: the release wrapper's one-line errors
        "preimports": False,  # spec §3.2: `python3 source.py` per call
        "observation_style": "release",
        "observation_max_chars": 256,  # spec §2.3 item 8: verl's max_tool_response_length, middle
        "tool_call_parsing": "release",
    },
    "rich": {
        "timeout_s": 4.0,
        "memory_mb": 2048,
        "memory_address_space": False,  # resident memory (the call's cgroup): an overrun kills the call
        "stream_cap_chars": 0,  # the sandbox's 64 KiB per stream, whose overrun kills the call
        "error_format": "traceback",
        "preimports": True,
        "observation_style": "release",
        "observation_max_chars": 4096,
        "tool_call_parsing": "rich",
    },
}


@dataclasses.dataclass(frozen=True)
class ToolEnv:
    preset: str
    timeout_s: float  # wall-clock limit of one call
    memory_mb: int
    memory_address_space: bool  # True: memory_mb bounds the address space (RLIMIT_AS), else resident memory
    stream_cap_chars: int  # > 0: stdout/stderr keep this many characters, the call runs on; 0: kill past the byte cap
    error_format: str  # "traceback" | "release" (sandbox_service.harness)
    preimports: bool  # False: numpy/sympy imports count against timeout_s
    observation_style: str  # "release" | "paper" (rstar_jax.agent.tool_calls.format_observation)
    observation_max_chars: int
    tool_call_parsing: str  # "release" | "rich" (rstar_jax.agent.tool_calls.parse_tool_calls)

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"ToolEnv.preset must be one of {tuple(PRESETS)}, got {self.preset!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"ToolEnv.timeout_s must be > 0, got {self.timeout_s!r}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 16):
            raise ValueError(f"ToolEnv.memory_mb must be an integer >= 16, got {self.memory_mb!r}")
        if not isinstance(self.memory_address_space, bool):
            raise ValueError(f"ToolEnv.memory_address_space must be True or False, got {self.memory_address_space!r}")
        if not (isinstance(self.stream_cap_chars, int) and 0 <= self.stream_cap_chars <= MAX_STREAM_CAP_CHARS):
            raise ValueError(f"ToolEnv.stream_cap_chars must be an integer in [0, {MAX_STREAM_CAP_CHARS}] (0: the "
                             f"sandbox's byte cap), got {self.stream_cap_chars!r}")
        if self.error_format not in ERROR_FORMATS:
            raise ValueError(f"ToolEnv.error_format must be one of {ERROR_FORMATS}, got {self.error_format!r}")
        if not isinstance(self.preimports, bool):
            raise ValueError(f"ToolEnv.preimports must be True or False, got {self.preimports!r}")
        if self.observation_style not in OBSERVATION_STYLES:
            raise ValueError(f"ToolEnv.observation_style must be one of {OBSERVATION_STYLES}, "
                             f"got {self.observation_style!r}")
        if not (isinstance(self.observation_max_chars, int) and self.observation_max_chars >= 1):
            raise ValueError(f"ToolEnv.observation_max_chars must be an integer >= 1, "
                             f"got {self.observation_max_chars!r}")
        if self.tool_call_parsing not in CALL_PARSING:
            raise ValueError(f"ToolEnv.tool_call_parsing must be one of {CALL_PARSING}, "
                             f"got {self.tool_call_parsing!r}")

    @classmethod
    def preset_defaults(cls, preset: str, **overrides) -> "ToolEnv":
        """The preset's environment, with `overrides` (field=value) in place of its values."""
        return cls(preset=preset, **{**PRESETS[preset], **overrides})

    def sandbox_options(self) -> dict:
        """The per-call options of `sandbox_service.client.SandboxClient.execute`."""
        return {"timeout_s": float(self.timeout_s), "memory_mb": self.memory_mb,
                "memory_address_space": self.memory_address_space, "stream_cap_chars": self.stream_cap_chars,
                "error_format": self.error_format, "cold_imports": not self.preimports}
