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

A tab opened by another page's script (``window.opener`` is set: a popup) does not start a console by itself:
it asks for a click first, so another site cannot fill the session slots with popups of the operator's key.

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
  window.addEventListener("load", () => {
    if (!window.opener) return go();
    say("Another page opened this tab: no console starts here by itself.");
    form.hidden = true;
    const button = document.getElementById("aerie-open");
    button.hidden = false;
    button.addEventListener("click", () => { window.opener = null; button.hidden = true; go(); });
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


def with_login(page: str) -> str:
    """textual-serve's rendered page with the login box and the session-key script before ``</body>``, and
    without its links to other origins (a web font)."""
    page = _EXTERNAL_LINK.sub("", page)
    tail = f"<style>{_STYLE}</style>{_BOX}<script>{_SCRIPT % {'key': html.escape(KEY_NAME)}}</script>"
    head, sep, rest = page.rpartition("</body>")
    if not sep:
        raise ValueError("textual-serve's page has no </body>: cannot add the login")
    return head + tail + sep + rest
