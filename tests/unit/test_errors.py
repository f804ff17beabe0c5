"""Errors are classes found by their code: an error that crossed a process boundary as code +
message is rebuilt as its class; a code no class owns keeps its code and status."""

from __future__ import annotations

import pytest

from shared.errors import GenerationFailed, JobMissing, ServiceError, UnknownError, error_from_code
from shared.events import Error


def test_an_error_event_is_rebuilt_as_the_class_that_made_it():
    event = Error.of(GenerationFailed("the engine fell over"), seq=3)
    assert (event.code, event.status) == ("generation_failed", 500)
    rebuilt = event.exception()
    assert type(rebuilt) is GenerationFailed and rebuilt.message == "the engine fell over"
    assert type(error_from_code("job_missing", "gone", 404)) is JobMissing


def test_a_code_no_class_owns_keeps_its_code_and_status():
    rebuilt = error_from_code("from_a_newer_worker", "something new", 418)
    assert type(rebuilt) is UnknownError and (rebuilt.code, rebuilt.status) == ("from_a_newer_worker", 418)
    # Codes whose class carries them per instance are never rebuilt as that class.
    assert type(error_from_code("http_error", "Method Not Allowed", 405)) is UnknownError


def test_a_second_class_with_a_taken_code_is_refused_at_its_definition():
    with pytest.raises(TypeError, match="'generation_failed' is taken by GenerationFailed"):
        class Again(ServiceError, code="generation_failed"):  # noqa: F841
            pass


def test_every_service_error_is_declared_and_exported_by_shared_errors():
    """An error declared elsewhere is registered only where that module happens to be imported,
    so a process that never imports it rebuilds the code as UnknownError."""
    import api.app  # noqa: F401  (imports every dialect and route module)
    import shared.errors as errors

    def subclasses(cls: type) -> list[type]:
        return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]

    declared = [c for c in subclasses(ServiceError) if c.__module__ != __name__]
    assert {c.__module__ for c in declared} == {"shared.errors"}
    assert {c.__name__ for c in declared} <= set(errors.__all__)
