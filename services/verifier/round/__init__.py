"""A round's rules, in one place: its budget (``budgets``), its draft and the fill it settles
(``draft``), the conditional drafts it holds (``conditional``), its state (``state``), its stop
rules (``stops``), and in the torch core its course from draft to verdict (``lifecycle``, imported
by its own path: it builds on the request and the scheduler).

The torch core, the vLLM core and the simulator's verifier (``bench/sim``) use these; none keeps
a copy of them.
"""

from services.verifier.round.budgets import DraftBudgets
from services.verifier.round.conditional import Offered, Upcoming
from services.verifier.round.draft import SettledDraft, filled_outcome, settle, settled_drafts
from services.verifier.round.stops import Stops, cut_at_stop_string

__all__ = ["DraftBudgets", "Offered", "SettledDraft", "Stops", "Upcoming", "cut_at_stop_string", "filled_outcome",
           "settle", "settled_drafts"]
