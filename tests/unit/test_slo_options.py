"""SLOs on a request (issue 44): the ``x-slo-*`` headers as read (api/context.py), the SLO a
request is queued with, field by field (api/submit.py ``resolve_slo``), a tenant's defaults as read
from its settings hash (shared/tenants.py), and the report a job's view carries (SloReport)."""

from __future__ import annotations

import msgspec
import pytest
from litestar.datastructures import Headers

from api.context import _slo
from api.submit import resolve_slo
from shared.errors import InvalidRequest
from shared.schemas import GenerationRequest, JobRecord, JobResult, JobView, SamplingParams, Slo, SloReport, Usage
from shared.tenants import TenantConfig, _config_of

# --- the headers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "slo"), [
    ({}, None),
    ({"x-slo-ttft-ms": "500"}, Slo(ttft_ms=500)),
    ({"X-SLO-TPOT-MS": " 50 "}, Slo(tpot_ms=50)),  # any case; whitespace around is no part of a value
    ({"x-slo-ttft-ms": "1", "x-slo-tpot-ms": "86400000"}, Slo(ttft_ms=1, tpot_ms=86_400_000)),
])
def test_slo_headers_are_whole_milliseconds(headers, slo):
    assert _slo(Headers(headers)) == (slo, None)


@pytest.mark.parametrize("value", ["0", "-5", "+5", "1.5", "1e3", "500ms", "soon", "", "86400001",
                                   "9" * 30, "٥٠٠"])  # the last: Arabic-Indic digits, which int() reads
@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
def test_any_other_value_is_an_invalid_request_naming_its_header(header, value):
    slo, bad = _slo(Headers({header: value, "x-slo-ttft-ms" if "tpot" in header else "x-slo-tpot-ms": "100"}))
    assert slo is None and isinstance(bad, InvalidRequest)
    assert bad.param == header and bad.status == 400 and header in bad.message


# --- field by field: body, header, tenant ---------------------------------------------------------


@pytest.mark.parametrize(("body", "headers", "tenant", "slo"), [
    (None, None, TenantConfig(), None),
    (Slo(), None, TenantConfig(), None),  # an empty body slo is no SLO
    (Slo(ttft_ms=500), Slo(ttft_ms=900, tpot_ms=50), TenantConfig(slo_ttft_ms=2000, slo_tpot_ms=40),
     Slo(ttft_ms=500, tpot_ms=50)),
    (None, Slo(ttft_ms=900), TenantConfig(slo_ttft_ms=2000, slo_tpot_ms=40), Slo(ttft_ms=900, tpot_ms=40)),
    (None, None, TenantConfig(slo_tpot_ms=40), Slo(tpot_ms=40)),
    (Slo(tpot_ms=10), None, TenantConfig(slo_ttft_ms=2000), Slo(ttft_ms=2000, tpot_ms=10)),
])
def test_each_field_comes_from_the_body_else_the_header_else_the_tenant(body, headers, tenant, slo):
    assert resolve_slo(body, headers, tenant) == slo


def test_a_tenants_defaults_are_read_from_its_hash_then_the_defaults_hash():
    own = {b"slo_ttft_ms": b"1500", b"max_queued": b"10"}
    defaults = {b"slo_ttft_ms": b"9000", b"slo_tpot_ms": b"60"}
    assert _config_of(own, defaults) == TenantConfig(max_queued=10, slo_ttft_ms=1500, slo_tpot_ms=60)
    assert _config_of({b"slo_tpot_ms": b"none"}, defaults) == TenantConfig(slo_ttft_ms=9000)
    # A hand-edited value no SLO may be is read like any other bad value: no settings at all.
    assert _config_of({b"slo_ttft_ms": b"0"}, {}) == TenantConfig()


# --- the report --------------------------------------------------------------------------------


def record(slo: Slo | None, **fields) -> JobRecord:
    req = GenerationRequest(prompt="p", sampling=SamplingParams(max_tokens=8), slo=slo)
    return JobRecord(id="j", model="tiny", request=req, queued_at=1_000_000.0, **fields)


def test_no_slo_no_report():
    view = JobView.of(record(None, status="done", first_token_at=1_000_100.0), None)
    assert view.slo is msgspec.UNSET
    assert b'"slo"' not in msgspec.json.encode(view)


def test_a_queued_job_reports_its_objective_and_nothing_measured():
    report = SloReport.of(record(Slo(ttft_ms=500, tpot_ms=50)))
    assert report == SloReport(objective=Slo(ttft_ms=500, tpot_ms=50), ttft_ms=None, tpot_ms=None,
                               ttft_met=None, tpot_met=None)


def test_a_running_job_reports_its_ttft_and_tpot_only_once_it_ended():
    running = record(Slo(ttft_ms=500, tpot_ms=50), status="running", first_token_at=1_000_499.5)
    assert SloReport.of(running) == SloReport(objective=Slo(ttft_ms=500, tpot_ms=50), ttft_ms=499.5, tpot_ms=None,
                                              ttft_met=True, tpot_met=None)
    # 11 tokens: 10 gaps in the 600 ms after the first.
    done = record(Slo(ttft_ms=500, tpot_ms=50), status="done", first_token_at=1_000_700.0,
                  finished_at=1_001_300.0, tokens="4 11")
    assert SloReport.of(done) == SloReport(objective=Slo(ttft_ms=500, tpot_ms=50), ttft_ms=700.0, tpot_ms=60.0,
                                           ttft_met=False, tpot_met=False)


def test_met_is_within_the_objective_inclusive():
    done = record(Slo(ttft_ms=700, tpot_ms=60), status="done", first_token_at=1_000_700.0,
                  finished_at=1_001_300.0, tokens="4 11")
    report = SloReport.of(done)
    assert report is not None and (report.ttft_met, report.tpot_met) == (True, True)


def test_only_the_objectives_asked_for_get_a_verdict():
    done = record(Slo(tpot_ms=60), status="done", first_token_at=1_000_700.0, finished_at=1_001_300.0,
                  tokens="4 11")
    report = SloReport.of(done)
    assert report is not None and (report.ttft_ms, report.ttft_met, report.tpot_met) == (700.0, None, True)


def test_a_job_that_ended_without_a_token_missed_its_ttft():
    failed = record(Slo(ttft_ms=500, tpot_ms=50), status="failed", finished_at=1_000_900.0)
    assert SloReport.of(failed) == SloReport(objective=Slo(ttft_ms=500, tpot_ms=50), ttft_ms=None, tpot_ms=None,
                                             ttft_met=False, tpot_met=None)


def test_one_token_has_no_time_per_token():
    done = record(Slo(ttft_ms=500, tpot_ms=50), status="done", first_token_at=1_000_100.0,
                  finished_at=1_000_101.0, tokens="4 1")
    report = SloReport.of(done)
    assert report is not None and (report.tpot_ms, report.tpot_met) == (None, None)


def test_the_view_carries_the_report_as_json():
    done = record(Slo(ttft_ms=500), status="done", first_token_at=1_000_250.0, finished_at=1_000_450.0,
                  tokens="4 3")
    body = msgspec.json.decode(msgspec.json.encode(JobView.of(done, None)))
    assert body["slo"] == {"objective": {"ttft_ms": 500}, "ttft_ms": 250.0, "tpot_ms": 100.0, "ttft_met": True,
                           "tpot_met": None}


def test_a_job_read_from_its_ending_counts_its_result_tokens():
    # Its ending is read a moment before its record's end writes the token counts (JobStore._ended).
    done = record(Slo(tpot_ms=50), status="done", first_token_at=1_000_100.0, finished_at=1_000_400.0,
                  result=JobResult(usage=Usage(prompt_tokens=4, completion_tokens=4)))
    report = SloReport.of(done)
    assert report is not None and (report.tpot_ms, report.tpot_met) == (100.0, False)
