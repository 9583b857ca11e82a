// The book's pages: typeset math with KaTeX, draw plotly figures from their saved JSON.
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
    Plotly.newPlot(div, fig.data || [], fig.layout || {}, {responsive: true, displaylogo: false});
  });
});
