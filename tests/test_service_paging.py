"""The service's paging parameters are ASCII digits within bounds: anything else is a 400 with one line, never an
exception (``str.isdigit`` accepts a superscript ``²``, which ``int`` refuses; ``int`` refuses 5,000 digits)."""

from __future__ import annotations

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.testclient import TestClient

from verified_ckpt.service.app import _page, build_app
from verified_ckpt.service.metrics import Metrics
from verified_ckpt.service.watch import Watchers

pytestmark = pytest.mark.timeout(60)

HOSTILE = ["²", "1²", "٣", "0x10", "-1", " 1", "1.0", "", "9" * 5000, "1" + "0" * 30]


def request(query: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/api/runs", "query_string": query.encode(),
                    "headers": []})


@pytest.mark.parametrize("name", ["offset", "limit"])
@pytest.mark.parametrize("raw", HOSTILE)
def test_the_paging_function_answers_400_to_a_value_int_refuses(name, raw):
    from urllib.parse import urlencode

    got = _page(request(urlencode({name: raw})))
    assert isinstance(got, Response) and got.status_code == 400
    assert f"{name} must be an integer from".encode() in got.body and b"\n" not in got.body


def test_the_paging_function_takes_its_bounds_and_defaults():
    assert _page(request("")) == (0, 500)
    assert _page(request("offset=000012&limit=5000")) == (12, 5000)
    assert _page(request("offset=1000000000000&limit=1")) == (10**12, 1)
    for bad in ("limit=0", "limit=5001", "offset=1000000000001"):
        assert isinstance(_page(request(bad)), Response)


def test_the_api_and_the_dashboard_answer_400_over_http():
    with TestClient(build_app(Watchers(), Metrics(), None), raise_server_exceptions=True) as client:
        for raw in ("²", "9" * 5000):
            assert client.get("/api/runs", params={"offset": raw}).status_code == 400
            assert client.get("/api/runs", params={"limit": raw}).status_code == 400
            page = client.get("/", params={"page": raw})
            assert page.status_code == 400 and page.text == "page must be an integer from 1 to 1000000000"
        assert client.get("/api/runs", params={"offset": "3"}).json() == []
        assert client.get("/", params={"page": "7"}).status_code == 200  # past the last page: the last one
