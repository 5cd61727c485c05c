// Put first in the <head> of the studio page by studio/pagescript.py (before Gradio's modules run).
//
// Gradio's status tracker (its statustracker-*.js) counts a run's elapsed time in a requestAnimationFrame loop
// that never stops: 60 frames a second for as long as the page is open, even on a page of one Textbox (Gradio 6.x,
// measured with bench/browser_compare.py's chromium). Each frame costs chromium a paint: ~10 % of a core while
// idle, taken from the decoding on a 2-core machine. Its frames are handed to setTimeout, 4 a second, instead;
// every other caller keeps requestAnimationFrame.
(() => {
  const TRACKER = "statustracker", EVERY_MS = 250;
  const raf = window.requestAnimationFrame.bind(window), caf = window.cancelAnimationFrame.bind(window);
  window.requestAnimationFrame = (callback) => {
    if (!(new Error().stack || "").includes(TRACKER)) return raf(callback);
    return -setTimeout(() => callback(performance.now()), EVERY_MS);  // negative: ours, for cancelAnimationFrame
  };
  window.cancelAnimationFrame = (id) => (id < 0 ? clearTimeout(-id) : caf(id));
})();

// A running Compare's texts, read from the studio (studio/live.py) rather than streamed through Gradio: each
// Gradio message costs chromium ~25-40 ms of CPU whatever it changes, taken from the decoding it shows on a
// 2-core machine. The Compare's summary carries a hidden marker naming the run while it goes; the page opens one
// response for it, a line of JSON twice a second while something changed (studio/live.py EVERY_S; a fetch per
// update cost the browser ~4x the CPU of a streamed line), and writes the texts with textContent. The final
// update replaces the summary, the columns and all.
(() => {
  let reading = null;  // the run whose stream is open
  const show = (mark, run) => {
    if (run.done) mark.dataset.done = "1";
    if (!mark.isConnected) return;
    for (const [arm, text] of Object.entries(run.texts || {})) {
      const out = document.querySelector(`#${CSS.escape(arm)}-text .pml-output`);
      if (!out || !text) continue;
      const active = (run.active || []).includes(arm);
      out.textContent = text;
      out.classList.toggle("active", active);
      if (active) out.append(Object.assign(document.createElement("span"), { className: "caret" }));
    }
    const line = mark.parentElement && mark.parentElement.querySelector(".pml-live-message");
    if (line && run.message) line.textContent = run.message;
  };
  const read = async (mark) => {
    const id = mark.dataset.live;
    reading = id;
    try {
      const answer = await fetch(`/pml-live/${encodeURIComponent(id)}`, { cache: "no-store" });
      const reader = answer.body.getReader(), utf8 = new TextDecoder();
      let held = "";
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        held += utf8.decode(value, { stream: true });
        const lines = held.split("\n");
        held = lines.pop();
        const last = lines.filter((l) => l.trim()).pop();  // lines that came together: the newest says it all
        if (last) show(mark, JSON.parse(last));
        if (!mark.isConnected) { reader.cancel(); break; }
      }
      if (!answer.ok) mark.dataset.done = "1";
    } catch (err) {
      // the studio stopped or restarted: the Compare's own updates say what happened (the marker is read again)
      await new Promise((resolve) => setTimeout(resolve, 1000));
    } finally {
      reading = null;
    }
  };
  setInterval(() => {  // a marker that appeared: open its stream (a look every 250 ms costs no frame)
    const mark = document.querySelector(".pml-live[data-live]:not([data-done])");
    if (mark && reading === null) read(mark);
  }, 250);
})();

// The editors never insert a closing tag the user did not type: CodeMirror's HTML mode closes a tag when
// ">" or "/" is typed after a tag name, even while the user types a closing tag ("</modulex" + ">" gave another
// "</module>"). Those two keys are typed here as plain characters, an undo step each as any typed character.
(() => {
  const EDITORS = "#schema-editor .cm-content, #prompt-editor .cm-content";
  const viewOf = (content) => {  // CodeMirror's EditorView behind its content element (tiles, or older views)
    const node = content.cmTile || content.cmView;
    return node ? (node.root && node.root.view) || (node.rootView && node.rootView.view) || node.view || null : null;
  };
  document.addEventListener("keydown", (event) => {
    if ((event.key !== ">" && event.key !== "/") || event.ctrlKey || event.metaKey || event.altKey) return;
    if (event.isComposing || !event.target.closest) return;
    const content = event.target.closest(EDITORS);
    const view = content && viewOf(content);
    if (!view) return;
    event.preventDefault();
    event.stopPropagation();
    view.dispatch({ ...view.state.replaceSelection(event.key), scrollIntoView: true, userEvent: "input.type" });
  }, true);
})();

// Ctrl+Shift+Z redoes in the editors, as Ctrl+Y does. CodeMirror binds Ctrl+Shift+Z to redo only where the browser says
// it runs on Linux; elsewhere (and for a small "z", as Caps Lock sends) the press was no redo. It is handed to
// CodeMirror as the Ctrl+Y it redoes with everywhere but on a Mac, whose Cmd+Shift+Z is left alone.
(() => {
  const EDITORS = "#schema-editor .cm-content, #prompt-editor .cm-content";
  document.addEventListener("keydown", (event) => {
    if (event.key.toLowerCase() !== "z" || !event.shiftKey || !event.ctrlKey || event.metaKey || event.altKey) return;
    const content = event.target.closest && event.target.closest(EDITORS);
    if (!content) return;
    event.preventDefault();
    event.stopPropagation();
    content.dispatchEvent(new KeyboardEvent("keydown", {
      key: "y", code: "KeyY", keyCode: 89, ctrlKey: true, bubbles: true, cancelable: true,
    }));
  }, true);
})();
