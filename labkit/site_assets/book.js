// The book's pages: typeset math with KaTeX, draw plotly figures from their saved JSON, and bring
// the calculators to life: Pyodide (copied into the site, _static/pyodide) runs labkit's own
// Python (labkit.widgets.web over labkit.costs) on every change of a control.
document.addEventListener("DOMContentLoaded", () => {
  renderMathInElement(document.querySelector("main"), {
    delimiters: [
      {left: "$$", right: "$$", display: true}, {left: "\\[", right: "\\]", display: true},
      {left: "$", right: "$", display: false}, {left: "\\(", right: "\\)", display: false},
    ],
    ignoredTags: ["script", "noscript", "style", "textarea", "pre", "code", "option"],
    throwOnError: false,
  });
  document.querySelectorAll("div.book-plotly").forEach((div) => {
    const fig = JSON.parse(document.getElementById(div.id + "-json").textContent);
    const config = {responsive: true, displaylogo: false};
    try {
      Plotly.newPlot(div, fig.data || [], fitLayout(fig.layout || {}, div), config);
    } catch (err) {   // a layout the narrow screen cannot hold: the figure as it was saved
      console.warn("book figure: drawn as saved (" + err + ")");
      Plotly.newPlot(div, fig.data || [], fig.layout || {}, config);
    }
  });
  document.querySelectorAll("div.book-frames").forEach(startFrames);
  const calcs = [...document.querySelectorAll("div.book-calc")];
  if (calcs.length && location.protocol !== "file:") startCalculators(calcs);
});

// A figure on a narrow screen (a phone): a width fixed wider than the page is dropped (plotly then
// fills the page), and a legend beside the plot moves under it, so the plot keeps the width.
function fitLayout(layout, div) {
  const width = div.clientWidth || window.innerWidth;
  const out = Object.assign({}, layout);
  if (out.width && out.width > width) {
    delete out.width;
    out.autosize = true;
  }
  if (width < 600) {
    const legend = out.legend || {};
    if (legend.orientation !== "h") {
      out.legend = Object.assign({}, legend, {orientation: "h", x: 0, xanchor: "left", y: -0.25,
                                              yanchor: "top"});
      out.margin = Object.assign({}, out.margin || {}, {r: 10});
    }
  }
  return out;
}

// What a control shows beside it, and what it sends to Python (a log range sends its exponent).
function controlValue(el) {
  if (el.type === "checkbox") return el.checked;
  if (el.tagName === "SELECT") return JSON.parse(el.value);
  return Number(el.value);
}

function showValue(el) {
  const out = el.parentElement.querySelector("output");
  if (!out) return;
  const x = el.dataset.kind === "log" ? Math.pow(10, Number(el.value)) : Number(el.value);
  out.textContent = Number(x.toPrecision(3)).toString();
}

// A figure explorer over frames drawn at build time (chapter 01's ring): N picks the frame list,
// step the frame; no Python needed, so it works from file:// too.
function startFrames(box) {
  const frames = JSON.parse(box.querySelector("script.book-frames-json").textContent);
  const form = box.querySelector("form");
  const n = form.elements.n, step = form.elements.step;
  const div = box.querySelector("div.book-plotly");
  const update = () => {
    const list = frames[n.value];
    step.max = String(list.length - 1);
    if (Number(step.value) > list.length - 1) step.value = String(list.length - 1);
    [n, step].forEach(showValue);
    const fig = list[Number(step.value)];
    div.style.height = ((fig.layout || {}).height || 450) + "px";
    Plotly.react(div, fig.data || [], fitLayout(fig.layout || {}, div));
  };
  [n, step].forEach((el) => el.addEventListener("input", update));
  [n, step].forEach(showValue);
  form.hidden = false;
}

async function startCalculators(calcs) {
  const status = (text) => calcs.forEach((c) => { c.querySelector(".book-calc-status").textContent = text; });
  status("Starting the calculator (Python in your browser, a few seconds the first time) …");
  const t0 = performance.now();
  try {
    const base = new URL(document.body.dataset.static + "/", location.href);
    const {loadPyodide} = await import(new URL("pyodide/pyodide.mjs", base).href);
    const py = await loadPyodide({indexURL: new URL("pyodide/", base).href});
    const zip = await (await fetch(new URL("labkit-calculators.zip", base))).arrayBuffer();
    py.unpackArchive(zip, "zip", {extractDir: "/home/pyodide/labkit-site"});
    py.runPython("import sys; sys.path.insert(0, '/home/pyodide/labkit-site')");
    const web = py.pyimport("labkit.widgets.web");
    for (const calc of calcs) {
      const form = calc.querySelector("form");
      const out = calc.querySelector(".book-calc-out");
      const controls = [...form.querySelectorAll("input, select")];
      const update = () => {
        controls.forEach(showValue);
        const raw = Object.fromEntries(controls.map((el) => [el.name, controlValue(el)]));
        out.textContent = web.render_inputs(calc.dataset.calc, JSON.stringify(raw));
        calc.dataset.renders = String(Number(calc.dataset.renders || 0) + 1);
      };
      controls.forEach((el) => el.addEventListener("input", update));
      form.hidden = false;
      update();
      calc.classList.add("live");
    }
    // ms from the page's navigation to live calculators, and of that, Pyodide's start + labkit
    document.body.dataset.calculatorsLiveMs = String(Math.round(performance.now()));
    document.body.dataset.calculatorsStartMs = String(Math.round(performance.now() - t0));
  } catch (err) {
    status("The live calculator could not start here (" + err + "); the text shows its default values.");
    console.warn("book calculators:", err);
  }
}
