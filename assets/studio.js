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
