"""The browser console's page for ``aerie serve``: textual-serve's terminal page with a login box and the script
that holds the session key (the design is in ``console/serve_guard.py``).

The page is public and the same for everyone: it holds no secret. Its script, run before textual-serve's
(which starts the terminal on ``window.onload``):

* takes the session key from ``sessionStorage`` (per tab and per origin: scheme, host and port), or shows the
  login box, whose token goes once in the body of ``POST /session`` (never in a URL: nothing lands in the
  browser's history) and is cleared from the box; the answer is the key, kept in ``sessionStorage``;
* asks ``GET /session`` (the key in ``X-Aerie-Session``) whether a console may start: 401 (a key of an
  earlier server) shows the login box again, 503 shows why (the slots are full);
* points the terminal at ``/ws/<key>`` and starts it. No request the browser makes on its own — a
  navigation, a link, a popup, a request to another port — carries the key: only this script sends it.

**A console starts by itself only in a tab the user opened directly**: a typed address, a bookmark, a link
from the terminal, or a reload of the console's own page — the browser says so in ``Sec-Fetch-Site`` (``none``
or ``same-origin``), a header no page can set, and the server writes the answer into the page it serves
(:func:`with_login`'s ``direct``). A tab that another page opened or navigated (``window.open``, with or
without ``noopener``, ``<a target=_blank>``, a redirect: ``same-site`` or ``cross-site``), or one with an opener,
or a browser that sends no such header, shows "Open the console here" and starts nothing — above all it
creates no session key under ``--no-token`` — until the user clicks that button. Only a real click on our own
page counts: another origin cannot script this page (nor frame it: ``X-Frame-Options: DENY``), the handler
takes only trusted events, and the button stays disabled for a second after the page is shown or regains
focus, so a click aimed at another page (a "double-click" trick that opens this tab under the pointer) lands
on a disabled button. So another page on this host cannot fill the session slots (``--max-sessions``) and
lock the operator out, with or without a token; the operator's own typed address always gets a console.

The page loads nothing from another origin: textual-serve's template asks Google Fonts for Roboto Mono, which
tells Google who opened a console and when, and stalls the page on an air-gapped cluster; that link is
removed, and the terminal uses the browser's own monospace font.
"""

from __future__ import annotations

import html
import re

KEY_NAME = "aerie-session"

TOKEN_IN_URL = (
    "<!DOCTYPE html><html><head><meta charset='utf-8'><title>aerie serve: token in the URL</title></head>"
    "<body style='font-family:monospace;background:#0c181f;color:#e0e0e0;padding:2em'>"
    "<p>aerie serve: a token in a URL is kept in the browser's history, so this console does not take it "
    "there. Open <a href='/' style='color:#9cf'>the console's page</a> and paste the token into its box "
    "(and remove this address from your history).</p></body></html>"
)

_STYLE = """
#aerie-login { position: absolute; inset: 0; z-index: 30; display: flex; align-items: center;
  justify-content: center; background: #0c181f; font-family: "Roboto Mono", menlo, monospace; }
#aerie-login[hidden] { display: none; }
#aerie-login .box { background: #12232d; color: rgba(255,255,255,0.95); padding: 2em; max-width: 640px; }
#aerie-login input { font-family: inherit; width: 28em; margin-right: 1em; }
"""

_SCRIPT = """
(() => {
  const KEY = "%(key)s";
  const DIRECT = %(direct)s;  // the user opened this tab (Sec-Fetch-Site: none or same-origin)
  const start = window.onload;  // textual-serve's: starts the terminal; run once a console may start
  window.onload = null;
  const box = document.getElementById("aerie-login");
  const form = document.getElementById("aerie-form");
  const input = document.getElementById("aerie-token");
  const say = (text) => { document.getElementById("aerie-say").textContent = text; };
  const ask = (text) => {
    say(text); form.hidden = false; document.getElementById("aerie-open").hidden = true;
    box.hidden = false; input.focus();
  };
  const stop = (text) => { say(text); form.hidden = true; box.hidden = false; };
  async function open(key) {
    const r = await fetch("/session", {headers: {"X-Aerie-Session": key}, cache: "no-store"});
    if (r.status === 401) {
      sessionStorage.removeItem(KEY);
      const info = await r.json();
      return info.token ? ask("This console needs its token (" + info.hint + ").") : login("");
    }
    if (!r.ok) return stop(await r.text());
    const info = await r.json();
    document.title = info.title;
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    document.getElementById("terminal").dataset.sessionWebsocketUrl =
      scheme + location.host + "/ws/" + encodeURIComponent(key);
    box.hidden = true;
    start();
  }
  async function login(token) {
    const r = await fetch("/session", {method: "POST", body: new URLSearchParams({token}), cache: "no-store"});
    const info = await r.json();
    if (!r.ok) return ask(info.error);
    sessionStorage.setItem(KEY, info.session);
    return open(info.session);
  }
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const token = input.value.trim();
    input.value = "";
    login(token);
  });
  const go = () => open(sessionStorage.getItem(KEY) || "-");
  const button = document.getElementById("aerie-open");
  const arm = () => {  // a click meant for another page (the tab opened under the pointer) finds it disabled
    button.disabled = true;
    clearTimeout(arm.timer);
    arm.timer = setTimeout(() => { button.disabled = false; }, 1000);
  };
  window.addEventListener("load", () => {
    if (DIRECT && !window.opener) return go();
    say("This tab was opened by another page (or a link): no console starts here without your click.");
    form.hidden = true;
    button.hidden = false;
    box.hidden = false;
    arm();
    document.addEventListener("visibilitychange", arm);
    window.addEventListener("focus", arm);
    button.addEventListener("click", (e) => {
      if (!e.isTrusted || button.disabled) return;
      window.opener = null;
      button.hidden = true;
      go();
    });
  });
})();
"""

_BOX = """
<div id="aerie-login" hidden><div class="box">
  <p id="aerie-say"></p>
  <form id="aerie-form" hidden autocomplete="off">
    <input id="aerie-token" type="password" name="token" placeholder="token" autocomplete="off">
    <button type="submit">Open</button>
  </form>
  <button id="aerie-open" type="button" hidden>Open the console here</button>
</div></div>
"""


_EXTERNAL_LINK = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>", re.IGNORECASE)


def opened_directly(sec_fetch_site: str | None) -> bool:
    """Whether the browser says the user opened this page: ``Sec-Fetch-Site`` is ``none`` (a typed address, a
    bookmark) or ``same-origin`` (a reload, a link of the console's own page). Absent (an old browser) or
    ``same-site``/``cross-site`` (another page opened or navigated the tab): no."""
    return (sec_fetch_site or "").strip().lower() in ("none", "same-origin")


def with_login(page: str, direct: bool = False) -> str:
    """textual-serve's rendered page with the login box and the session-key script before ``</body>``, and
    without its links to other origins (a web font). Unless ``direct`` (:func:`opened_directly`), the page
    starts nothing until the user clicks "Open the console here"."""
    page = _EXTERNAL_LINK.sub("", page)
    script = _SCRIPT % {"key": html.escape(KEY_NAME), "direct": "true" if direct else "false"}
    tail = f"<style>{_STYLE}</style>{_BOX}<script>{script}</script>"
    head, sep, rest = page.rpartition("</body>")
    if not sep:
        raise ValueError("textual-serve's page has no </body>: cannot add the login")
    return head + tail + sep + rest
