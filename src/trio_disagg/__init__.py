"""trio-disagg: disaggregated (prefill/decode) LLM serving on trio.

The core: :class:`RequestContext`, :class:`RequestTracker`, prefill classification,
the :class:`TransferKeeper` and the :class:`Gatekeeper` (the C, S, T and G rules in
docs/semantics.md).
"""

from ._context import RequestContext as RequestContext
from ._engine import CancelWindow as CancelWindow
from ._engine import DecodeEngine as DecodeEngine
from ._engine import Engine as Engine
from ._engine import HandoffStyle as HandoffStyle
from ._engine import PrefillEngine as PrefillEngine
from ._engine import cancel_window_of as cancel_window_of
from ._errors import DeadlineExceeded as DeadlineExceeded
from ._errors import InvalidPrefillHandoff as InvalidPrefillHandoff
from ._errors import NoDisaggregatedParams as NoDisaggregatedParams
from ._errors import NoWorkerAvailable as NoWorkerAvailable
from ._errors import PrefillCancelled as PrefillCancelled
from ._errors import PrefillDeadlineExceeded as PrefillDeadlineExceeded
from ._errors import PrefillError as PrefillError
from ._errors import RouterClosed as RouterClosed
from ._errors import TrioDisaggError as TrioDisaggError
from ._errors import WireFormatError as WireFormatError
from ._errors import WorkerError as WorkerError
from ._gate import GatedOutputs as GatedOutputs
from ._gate import Gatekeeper as Gatekeeper
from ._gate import is_decode_failure as is_decode_failure
from ._handoff import HandoffOwner as HandoffOwner
from ._handoff import HandoffState as HandoffState
from ._health import HealthMonitor as HealthMonitor
from ._health import HealthProbe as HealthProbe
from ._health import HealthState as HealthState
from ._health import RetryPolicy as RetryPolicy
from ._health import WorkerHealth as WorkerHealth
from ._keeper import PrefillTask as PrefillTask
from ._keeper import TransferKeeper as TransferKeeper
from ._keeper import TransferLeg as TransferLeg
from ._pool import LeastOutstanding as LeastOutstanding
from ._pool import PrefixAffinity as PrefixAffinity
from ._pool import RoundRobin as RoundRobin
from ._pool import SelectionPolicy as SelectionPolicy
from ._pool import SessionAffinity as SessionAffinity
from ._pool import Worker as Worker
from ._pool import WorkerPool as WorkerPool
from ._prefill import Handoff as Handoff
from ._prefill import PrefillCompletion as PrefillCompletion
from ._prefill import Terminal as Terminal
from ._prefill import check_prefill_output as check_prefill_output
from ._prefill import classify_first_output as classify_first_output
from ._prefill import consume_prefill_stream as consume_prefill_stream
from ._prefill import drain_prefill_outputs as drain_prefill_outputs
from ._prefill import is_bootstrap_params as is_bootstrap_params
from ._protocols import DEFAULT_BOOTSTRAP_PORT as DEFAULT_BOOTSTRAP_PORT
from ._protocols import Annotated as Annotated
from ._protocols import BootstrapInfo as BootstrapInfo
from ._protocols import ChunkChoice as ChunkChoice
from ._protocols import CompletionUsage as CompletionUsage
from ._protocols import FinishKind as FinishKind
from ._protocols import FinishReason as FinishReason
from ._protocols import LLMEngineOutput as LLMEngineOutput
from ._protocols import PrefillResult as PrefillResult
from ._protocols import PreprocessedRequest as PreprocessedRequest
from ._protocols import PromptTokensDetails as PromptTokensDetails
from ._protocols import RawChoice as RawChoice
from ._protocols import RawChoices as RawChoices
from ._protocols import RoutingHints as RoutingHints
from ._protocols import TraceLink as TraceLink
from ._protocols import converter as converter
from ._protocols import from_wire as from_wire
from ._protocols import to_wire as to_wire
from ._router import Deadlines as Deadlines
from ._router import DisaggRouter as DisaggRouter
from ._router import RequestStream as RequestStream
from ._router import RouterCounters as RouterCounters
from ._tracker import Phase as Phase
from ._tracker import PhasePermit as PhasePermit
from ._tracker import RequestTracker as RequestTracker

__version__ = "0.1.0"
