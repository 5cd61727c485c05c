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

// A running Compare's texts, fetched from the studio (studio/live.py) rather than streamed through Gradio: each
// Gradio message costs chromium ~25-40 ms of CPU whatever it changes, taken from the decoding it shows on a
// 2-core machine; a fetch written with textContent costs about a millisecond. The Compare's summary carries a
// hidden marker naming the run while it goes; the final update replaces the summary, the columns and all.
(() => {
  let busy = false;
  const poll = async () => {
    const mark = document.querySelector(".pml-live[data-live]:not([data-done])");
    if (!mark || busy) return;
    busy = true;
    try {
      const answer = await fetch(`/pml-live/${encodeURIComponent(mark.dataset.live)}`, { cache: "no-store" });
      const run = answer.ok ? await answer.json() : { done: true };
      if (run.done) mark.dataset.done = "1";
      for (const [arm, text] of Object.entries(run.texts || {})) {
        const out = document.querySelector(`#${CSS.escape(arm)}-text .pml-output`);
        if (!out || !text || !mark.isConnected) continue;
        const active = (run.active || []).includes(arm);
        out.textContent = text;
        out.classList.toggle("active", active);
        if (active) out.append(Object.assign(document.createElement("span"), { className: "caret" }));
      }
      const line = mark.parentElement && mark.parentElement.querySelector(".pml-live-message");
      if (line && run.message && mark.isConnected) line.textContent = run.message;
    } catch (err) {
      // the studio stopped or restarted: the Compare's own updates say what happened
    } finally {
      busy = false;
    }
  };
  setInterval(poll, 250);
})();
