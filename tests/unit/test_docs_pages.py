"""/docs and /redoc render without internet: every script, stylesheet and icon they name is
served by the API itself (package fastapi-offline), none by a CDN."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

REFERENCE = re.compile(r"""(?:src|href|spec-url)="([^"]+)"|url: '([^']+)'""")


def references(html: str) -> list[str]:
    return [a or b for a, b in REFERENCE.findall(html)]


@pytest.mark.parametrize("page,assets", [
    ("/docs", {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css",
               "/docs/assets/favicon.png", "/openapi.json"}),
    ("/redoc", {"/docs/assets/redoc.standalone.js", "/docs/assets/favicon.png",
                "/openapi.json"}),
])
def test_a_docs_page_names_only_local_assets_and_they_are_served(
        client: TestClient, page: str, assets: set[str]) -> None:
    response = client.get(page)
    assert response.status_code == 200
    assert "http://" not in response.text and "https://" not in response.text
    assert set(references(response.text)) == assets
    for url in assets:
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 1000, url


def test_the_swagger_oauth2_redirect_page_is_served(client: TestClient) -> None:
    response = client.get("/docs/oauth2-redirect")
    assert response.status_code == 200 and "swaggerUIRedirectOauth2" in response.text
