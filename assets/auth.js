// The studio's credential in the page (studio/guard.py): first in the <head> of the bootstrap page and of the studio's
// page, before Gradio's modules run.
//
// The launch token lives in this tab's sessionStorage, which only this origin (scheme, host AND port) can read; the
// browser never sends it by itself (a cookie for 127.0.0.1 goes to every port, so another account's server on
// another port would get it). The page's own requests carry it as `Authorization: Bearer`: fetch and
// XMLHttpRequest are wrapped (Gradio's client opens its event streams with fetch). Files the page loads by URL
// (images, downloads: /gradio_api/file=…) cannot carry a header: their links get a signature, HMAC-SHA256 of the
// expiry and the path keyed by the token, valid LIFE_S seconds, set when the page sets the link and again at a click.
(() => {
  if (window.__pmlAuth) return window.__pmlAuth.listen();  // the page written over the bootstrap page (its document's
  // listeners went with document.open(); the window, its fetch and its prototypes stayed)
  const KEY = "pml-studio-token", FILES = "/gradio_api/file=", LIFE_S = 120;
  const token = () => { try { return sessionStorage.getItem(KEY); } catch { return null; } };
  const here = (url) => {
    try { return new URL(url, location.href).origin === location.origin; } catch { return false; }
  };
  window.__pmlAuth = { KEY, token };

  const fetchOwn = window.fetch.bind(window);
  window.fetch = (input, init) => {
    const t = token(), url = input instanceof Request ? input.url : String(input);
    if (!t || !here(url)) return fetchOwn(input, init);
    const headers = new Headers((init && init.headers) || (input instanceof Request ? input.headers : undefined));
    if (!headers.has("authorization")) headers.set("Authorization", `Bearer ${t}`);
    return fetchOwn(input, { ...(init || {}), headers });
  };
  const { open, send, setRequestHeader } = XMLHttpRequest.prototype;
  XMLHttpRequest.prototype.open = function (method, url, ...rest) {
    this.__pmlOwn = here(url);
    return open.call(this, method, url, ...rest);
  };
  XMLHttpRequest.prototype.setRequestHeader = function (name, value) {
    if (String(name).toLowerCase() === "authorization") this.__pmlSet = true;
    return setRequestHeader.call(this, name, value);
  };
  XMLHttpRequest.prototype.send = function (body) {
    const t = token();
    if (t && this.__pmlOwn && !this.__pmlSet) setRequestHeader.call(this, "Authorization", `Bearer ${t}`);
    return send.call(this, body);
  };

  // SHA-256 and HMAC (RFC 2104), synchronous: a link is signed while the page sets it (crypto.subtle is async)
  const K = [0x428a2f98,0x71374491,0xb5c0fbcf,0xe9b5dba5,0x3956c25b,0x59f111f1,0x923f82a4,0xab1c5ed5,0xd807aa98,
    0x12835b01,0x243185be,0x550c7dc3,0x72be5d74,0x80deb1fe,0x9bdc06a7,0xc19bf174,0xe49b69c1,0xefbe4786,0x0fc19dc6,
    0x240ca1cc,0x2de92c6f,0x4a7484aa,0x5cb0a9dc,0x76f988da,0x983e5152,0xa831c66d,0xb00327c8,0xbf597fc7,0xc6e00bf3,
    0xd5a79147,0x06ca6351,0x14292967,0x27b70a85,0x2e1b2138,0x4d2c6dfc,0x53380d13,0x650a7354,0x766a0abb,0x81c2c92e,
    0x92722c85,0xa2bfe8a1,0xa81a664b,0xc24b8b70,0xc76c51a3,0xd192e819,0xd6990624,0xf40e3585,0x106aa070,0x19a4c116,
    0x1e376c08,0x2748774c,0x34b0bcb5,0x391c0cb3,0x4ed8aa4a,0x5b9cca4f,0x682e6ff3,0x748f82ee,0x78a5636f,0x84c87814,
    0x8cc70208,0x90befffa,0xa4506ceb,0xbef9a3f7,0xc67178f2];
  const sha256 = (bytes) => {
    const bits = bytes.length * 8, total = ((bytes.length + 9 + 63) >> 6) << 6;
    const m = new Uint8Array(total);
    m.set(bytes);
    m[bytes.length] = 0x80;
    new DataView(m.buffer).setUint32(total - 4, bits >>> 0);
    new DataView(m.buffer).setUint32(total - 8, Math.floor(bits / 2 ** 32));
    const h = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];
    const w = new Uint32Array(64), view = new DataView(m.buffer), rot = (x, n) => (x >>> n) | (x << (32 - n));
    for (let off = 0; off < total; off += 64) {
      for (let i = 0; i < 16; i++) w[i] = view.getUint32(off + 4 * i);
      for (let i = 16; i < 64; i++) {
        const s0 = rot(w[i - 15], 7) ^ rot(w[i - 15], 18) ^ (w[i - 15] >>> 3);
        const s1 = rot(w[i - 2], 17) ^ rot(w[i - 2], 19) ^ (w[i - 2] >>> 10);
        w[i] = (w[i - 16] + s0 + w[i - 7] + s1) | 0;
      }
      let [a, b, c, d, e, f, g, k] = h;
      for (let i = 0; i < 64; i++) {
        const t1 = (k + (rot(e, 6) ^ rot(e, 11) ^ rot(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i]) | 0;
        const t2 = ((rot(a, 2) ^ rot(a, 13) ^ rot(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))) | 0;
        [k, g, f, e, d, c, b, a] = [g, f, e, (d + t1) | 0, c, b, a, (t1 + t2) | 0];
      }
      [a, b, c, d, e, f, g, k].forEach((x, i) => { h[i] = (h[i] + x) | 0; });
    }
    const out = new Uint8Array(32);
    h.forEach((x, i) => new DataView(out.buffer).setUint32(4 * i, x >>> 0));
    return out;
  };
  const utf8 = (s) => new TextEncoder().encode(s);
  const hmac = (key, text) => {
    let k = utf8(key);
    if (k.length > 64) k = sha256(k);
    const pad = (x) => { const p = new Uint8Array(64).fill(x); k.forEach((b, i) => { p[i] ^= b; }); return p; };
    const cat = (a, b) => { const c = new Uint8Array(a.length + b.length); c.set(a); c.set(b, a.length); return c; };
    const digest = sha256(cat(pad(0x5c), sha256(cat(pad(0x36), utf8(text)))));
    return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
  };
  window.__pmlAuth.hmac = hmac;

  const sign = (value) => {  // a link to one of the studio's files, with a fresh signature; any other value as it is
    const t = token();
    let url, path;
    try {
      url = new URL(String(value), location.href);
      path = decodeURIComponent(url.pathname);
    } catch { return value; }
    if (!t || url.origin !== location.origin || !url.pathname.startsWith(FILES)) return value;
    const exp = Math.floor(Date.now() / 1000) + LIFE_S;
    url.searchParams.set("pml_exp", String(exp));
    url.searchParams.set("pml_sig", hmac(t, `${exp}\n${path}`));
    return url.href;
  };
  window.__pmlAuth.sign = sign;
  const LINKS = [["HTMLAnchorElement", "href"], ["HTMLImageElement", "src"], ["HTMLSourceElement", "src"],
    ["HTMLMediaElement", "src"], ["HTMLLinkElement", "href"], ["HTMLIFrameElement", "src"]];
  for (const [cls, attr] of LINKS) {
    const proto = window[cls] && window[cls].prototype, d = proto && Object.getOwnPropertyDescriptor(proto, attr);
    if (d && d.set) Object.defineProperty(proto, attr, { ...d, set(v) { d.set.call(this, sign(v)); } });
  }
  const setAttribute = Element.prototype.setAttribute;
  Element.prototype.setAttribute = function (name, value) {
    const n = String(name).toLowerCase();
    return setAttribute.call(this, name, n === "src" || n === "href" ? sign(value) : value);
  };
  const openWindow = window.open;
  window.open = function (url, ...rest) {
    return openWindow.call(window, url === undefined ? url : sign(url), ...rest);
  };
  const resign = (el) => {  // links written as HTML (no setter ran), and a link clicked after its signature expired
    for (const attr of ["href", "src"]) {
      const v = el.getAttribute && el.getAttribute(attr);
      if (v && v.includes(FILES)) setAttribute.call(el, attr, sign(v));
    }
  };
  const listen = () => {
    document.addEventListener("click", (e) => {
      const a = e.target.closest && e.target.closest("a[href]");
      if (a) resign(a);
    }, true);
    document.addEventListener("error", (e) => {  // an image that loaded after its link expired: signed again, once
      const el = e.target;
      if (el && el.getAttribute && !el.__pmlRetried && String(el.getAttribute("src") || "").includes(FILES)) {
        el.__pmlRetried = true;
        resign(el);
      }
    }, true);
    new MutationObserver((changes) => {
      for (const c of changes) {
        const els = c.type === "attributes" ? [c.target] : Array.from(c.addedNodes).filter((n) => n.nodeType === 1);
        for (const el of els) {
          for (const x of [el, ...el.querySelectorAll("[src],[href]")]) {
            const v = x.getAttribute(x.hasAttribute("src") ? "src" : "href") || "";
            if (v.includes(FILES) && !v.includes("pml_sig=")) resign(x);
          }
        }
      }
    }).observe(document, { subtree: true, childList: true, attributes: true, attributeFilter: ["src", "href"] });
  };
  window.__pmlAuth.listen = listen;
  listen();
})();
