"""--api-key / --admin-api-key, control routes POST-only with a JSON content type, no docs by
default, no secrets in /server_info."""
from __future__ import annotations

import pytest
import requests

from server_utils import start_server

pytestmark = pytest.mark.timeout(300)  # a server start may take 180 s (server_utils)
KEY, ADMIN = "user-secret", "admin-secret"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_model_dir):
    logs = tmp_path_factory.mktemp("auth")
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "2000",
                           "--api-key", KEY, "--admin-api-key", ADMIN], str(logs / "server.log"))
    yield server
    server.stop()


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_probes_and_metrics_needs_the_key(keyed_server):
    """As SGLang: /health*, /metrics (Prometheus scrapers, health probes) are open."""
    url = keyed_server.url
    for path in ("/health", "/health_generate", "/metrics"):
        assert requests.get(url + path, timeout=30).status_code == 200, path
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    for method, path in (("post", "/generate"), ("get", "/get_server_info"), ("get", "/v1/models"),
                         ("post", "/abort_request"), ("get", "/get_model_info")):
        resp = requests.request(method, url + path, json=body if path == "/generate" else {}, timeout=30)
        assert resp.status_code == 401, path
        assert requests.request(method, url + path, json={}, timeout=30, headers=_auth("wrong")).status_code == 401
    ok = requests.post(url + "/generate", json=body, headers=_auth(KEY), timeout=30)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
    assert requests.post(url + "/generate", json=body, headers=_auth(ADMIN), timeout=30).status_code == 200


def test_control_routes_need_the_admin_key_and_no_browser_from_another_site(keyed_server):
    url = keyed_server.url
    assert requests.post(url + "/flush_cache", json={}, headers=_auth(KEY), timeout=30).status_code == 403
    assert requests.post(url + "/flush_cache", json={}, headers=_auth(ADMIN), timeout=30).status_code == 200
    # SGLang's forms: GET, and a POST with no body or content type (its gateway's fan-out)
    assert requests.get(url + "/flush_cache", headers=_auth(ADMIN), timeout=30).status_code == 200
    assert requests.post(url + "/flush_cache", headers=_auth(ADMIN), timeout=30).status_code == 200
    for browser in ({"Origin": "https://elsewhere.example"}, {"Sec-Fetch-Site": "cross-site"}):
        assert requests.post(url + "/flush_cache", headers={**_auth(ADMIN), **browser},
                             timeout=30).status_code == 403, browser
    form = requests.post(url + "/abort_request", data="rid=x", timeout=30,
                         headers={**_auth(ADMIN), "Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415  # what a cross-site form could send
    everything = {"abort_all": True}
    assert requests.post(url + "/abort_request", json=everything, headers=_auth(KEY), timeout=30).status_code == 403
    assert requests.post(url + "/abort_request", json=everything, headers=_auth(ADMIN), timeout=30).status_code == 200
    one = {"rid": "nobody"}
    assert requests.post(url + "/abort_request", json=one, headers=_auth(KEY), timeout=30).status_code == 200


def test_no_docs_and_no_secrets(keyed_server):
    url = keyed_server.url
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert requests.get(url + path, headers=_auth(KEY), timeout=30).status_code == 404, path
    info = requests.get(url + "/get_server_info", headers=_auth(KEY), timeout=30)
    text = info.text
    assert info.status_code == 200 and "model_path" in info.json()
    assert KEY not in text and ADMIN not in text and "api_key" not in text
