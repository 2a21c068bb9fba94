"""The spec an `apply` writes over a live run: kubectl apply's three-way merge, on plain dicts.

Who calls it: `TrainingRun.applied_spec`, for `mortalctl apply`, the watched folder and MortalTrainer
(through mortal.state.apply_document, which re-reads and retries when the run moved under it).

Three inputs besides the document's normal form:
1. live          the spec the store holds now (changed since by scale, suspend, resume, rollback),
2. last_applied  the fields the previous apply's document set (None: never applied, e.g. forked),
3. config        the fields this document sets (pydantic's exclude_unset dump).

A field this document sets takes its value; a field the previous document set and this one no longer
does goes back to its default (a mapping dropped whole: the fields in it the previous document set); any
other field keeps the live value, so re-applying the file a run was
scaled or suspended from does not undo the scale or resume the run. As with kubectl, a field the file
does set wins over a scale: leave `replicas` out of a file whose run is scaled by hand.

Mappings merge key by key; anything else (lists included: rewards, tools) is replaced whole, as
kubectl replaces a list that has no merge key. A live key the normal form lacks is dropped: only an
apply adds keys (scale and suspend change values), so such a key is an earlier document's. Pure: no
store, no I/O.
"""

from __future__ import annotations

from typing import Any

Spec = dict[str, Any]


def merge_applied(live: Spec, last_applied: Spec | None, config: Spec, normalized: Spec) -> Spec:
    """The merged spec (before validation): `normalized` is `config` with every default filled in."""
    return _merge_level(live, last_applied or {}, config, normalized)


def _merge_level(live: Spec, last: Spec, config: Spec, normalized: Spec) -> Spec:
    merged: Spec = {}
    for key, default in normalized.items():
        if key in config:  # the document's; a mapping it sets part of merges below it
            merged[key] = _below(live.get(key), last.get(key), config[key], default)
        elif key in last:  # the previous document set it and this one not: below it, what that one set
            merged[key] = _below(live.get(key), last[key], {}, default)
        elif (
            key in live
        ):  # never a document's: whoever set it (scale, suspend) or the default it had keeps it
            merged[key] = live[key]
        else:  # new to the schema
            merged[key] = default
    return merged


def _below(live: Any, last: Any, config: Any, normalized: Any) -> Any:
    """A key the document sets (or the previous one did): its mapping merged key by key, anything else
    the document's normal form."""
    if all(isinstance(v, dict) for v in (live, config, normalized)):
        return _merge_level(live, last if isinstance(last, dict) else {}, config, normalized)
    return normalized
