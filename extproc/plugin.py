"""The engine author's API: everything an engine's module needs from pd-extproc, and nothing else.

An engine outside this package (a ``pd_extproc.engines`` entry point naming an ``Engine``) imports from
here only, so the package's own layout can change without breaking it. Its emulator, if it has one,
imports from ``pd_extproc_lab.plugin``. tests/plugin_engine/toy_engine.py is a whole engine written
against these two modules. ``FakeTransport`` stands in for the workers in an engine's own tests: the
processor's transport, answered from a script, every call recorded; ``FakeClock`` is the time such a
test moves by hand (a processor, a cache or a watch takes its ``Clock`` as an argument).
"""

from __future__ import annotations

from extproc.adapters.base import (
    AnswerDirectly,
    ConcurrentAdapter,
    ConcurrentPlan,
    Decision,
    DecodeAbort,
    DecodeWith,
    Demo,
    Engine,
    Flow,
    Options,
    PlanInput,
    QueueGauges,
    SequentialAdapter,
    ServerInfo,
)
from extproc.clock import Clock, FakeClock, MonotonicClock
from extproc.protocol import jsonspan
from extproc.protocol.errors import Code, PdError, Problem
from extproc.protocol.fields import (
    FieldRule,
    FieldRules,
    ReservedField,
    equals,
    handoff_error,
    int_at_least,
    is_int,
    is_port,
    list_of,
    non_empty_str,
    null_or,
    set_members,
)
from extproc.protocol.openai_request import ClientRequest, Endpoint
from extproc.protocol.prefill_json import parse_prefill_object, upstream_status_error
from extproc.protocol.settings_spec import (
    SecretFileError,
    SettingSpec,
    choice,
    existing_file,
    non_negative_int,
    parse_bool,
    positive_duration,
    positive_int,
    positive_size,
    read_secret_file,
    read_token_file,
    text_value,
)
from extproc.protocol.transport import WorkerAddress, WorkerReply
from extproc.upstream.fake_transport import FakeTransport, RecordedCall, ScriptedAnswer

__all__ = [
    "AnswerDirectly",
    "ClientRequest",
    "Clock",
    "Code",
    "ConcurrentAdapter",
    "ConcurrentPlan",
    "Decision",
    "DecodeAbort",
    "DecodeWith",
    "Demo",
    "Endpoint",
    "Engine",
    "FakeClock",
    "FakeTransport",
    "FieldRule",
    "FieldRules",
    "Flow",
    "MonotonicClock",
    "Options",
    "PdError",
    "PlanInput",
    "Problem",
    "QueueGauges",
    "RecordedCall",
    "ReservedField",
    "ScriptedAnswer",
    "SecretFileError",
    "SequentialAdapter",
    "ServerInfo",
    "SettingSpec",
    "WorkerAddress",
    "WorkerReply",
    "choice",
    "equals",
    "existing_file",
    "handoff_error",
    "int_at_least",
    "is_int",
    "is_port",
    "jsonspan",
    "list_of",
    "non_empty_str",
    "non_negative_int",
    "null_or",
    "parse_bool",
    "parse_prefill_object",
    "positive_duration",
    "positive_int",
    "positive_size",
    "read_secret_file",
    "read_token_file",
    "set_members",
    "text_value",
    "upstream_status_error",
]
