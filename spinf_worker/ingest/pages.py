"""``--fetch-pages``: when a feed item carries only a summary, fetch its linked page and
extract the main text with trafilatura.

Links come from the feed, i.e. from whoever writes it, so a page is fetched under the same
rules as webhook callbacks (webhooks.py's TargetGuard): public addresses only unless
allowed (``fetch_allow``), the connection pinned to the checked address, and every redirect
checked again.
"""

from __future__ import annotations

import asyncio

import httpx
import structlog

from ..webhooks import CallbackRefused, TargetGuard

log = structlog.get_logger("spinf.ingest")

MAX_REDIRECTS = 5
MAX_PAGE_BYTES = 5 * 1024 * 1024
TIMEOUT_S = 15.0
USER_AGENT = "spinf-serve-ingest"


class PageFetcher:
    def __init__(self, allow: tuple[str, ...] = ()):
        self.guard = TargetGuard(allow)
        # no keep-alive: each request goes to a pinned IP (see queue/callbacks.py)
        self.client = httpx.AsyncClient(
            timeout=TIMEOUT_S, follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
            headers={"user-agent": USER_AGENT})

    async def close(self) -> None:
        await self.client.aclose()

    async def text(self, url: str) -> str | None:
        """The page's main text, or None (refused, failed, not HTML, nothing extracted)."""
        try:
            html = await self._get(url)
        except (CallbackRefused, httpx.HTTPError, ValueError) as err:
            log.info("page not fetched", url=url, error=str(err))
            return None
        if html is None:
            return None
        import trafilatura

        extracted = await asyncio.to_thread(trafilatura.extract, html, url=url,
                                            include_comments=False, include_tables=False)
        return extracted.strip() if extracted else None

    async def _get(self, url: str) -> str | None:
        for _ in range(MAX_REDIRECTS + 1):
            target = await self.guard.resolve(url)
            extensions = {"sni_hostname": target.url.host} if target.url.scheme == "https" else {}
            headers = {"host": target.url.netloc.decode("ascii")}
            async with self.client.stream("GET", target.request_url(), headers=headers,
                                          extensions=extensions) as response:
                if response.is_redirect and "location" in response.headers:
                    url = str(target.url.join(response.headers["location"]))
                    continue
                if response.status_code != 200:
                    raise ValueError(f"HTTP {response.status_code}")
                kind = response.headers.get("content-type", "")
                if "html" not in kind and "xml" not in kind:
                    return None
                body = bytearray()
                async for part in response.aiter_bytes():
                    body += part
                    if len(body) > MAX_PAGE_BYTES:
                        raise ValueError(f"page larger than {MAX_PAGE_BYTES} bytes")
                return body.decode(response.encoding or "utf-8", errors="replace")
        raise ValueError(f"more than {MAX_REDIRECTS} redirects")
