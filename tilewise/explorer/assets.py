"""The report's inline style and script: the page must work offline, from a file, with no CDN."""

CSS = """
body { font: 14px/1.45 "DejaVu Sans", "Liberation Sans", Arial, sans-serif; color: #212529;
       margin: 0 24px 40px; background: #fff; }
h1 { font-size: 22px; margin: 18px 0 2px; } h2 { font-size: 18px; margin: 28px 0 8px;
     border-bottom: 1px solid #dee2e6; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 0; display: inline; }
.sub { color: #6c757d; margin: 0 0 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 8px; }
.card { border: 1px solid #dee2e6; border-radius: 6px; padding: 6px 10px; min-width: 130px; }
.card b { display: block; font-size: 17px; } .card span { color: #6c757d; font-size: 12px; }
table { border-collapse: collapse; margin: 6px 0 10px; }
th, td { border: 1px solid #dee2e6; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f1f3f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .mono { font-family: "DejaVu Sans Mono", "Liberation Mono", monospace; font-size: 12px; }
tr.region-row { cursor: pointer; } tr.region-row:hover { background: #f8f9fa; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 5px;
          vertical-align: -1px; }
.bar { display: inline-block; height: 10px; background: #74c0fc; vertical-align: middle; }
details.segment { border: 1px solid #dee2e6; border-radius: 6px; margin: 10px 0; padding: 6px 10px; }
details.segment > summary { cursor: pointer; }
.counts { color: #495057; margin: 4px 0; } .note { color: #c92a2a; margin: 4px 0; }
.scroll { overflow: auto; max-height: 720px; border-top: 1px solid #f1f3f5; margin-top: 6px; }
.legend { display: flex; gap: 14px; flex-wrap: wrap; margin: 6px 0; font-size: 13px; }
svg.graph text { font-family: "DejaVu Sans Mono", "Liberation Mono", monospace; font-size: 10px; }
svg.graph .edges path { fill: none; stroke: #adb5bd; stroke-width: 1; }
svg.graph .region rect { fill: #f8fff8; stroke-width: 2; }
svg.graph .region text { font-weight: bold; }
svg.graph .node rect { stroke: #868e96; stroke-width: 1; }
svg.graph .node text { text-anchor: middle; fill: #212529; }
svg.graph .node.view rect { stroke-dasharray: 3 2; }
svg.graph .node.compiled rect { fill: #d3f9d8; stroke-width: 2; }
svg.graph .node.dynamic rect { fill: #ffd8a8; stroke: #d9480f; }
svg.graph .node.warming rect { fill: #e9ecef; }
svg.graph .node.uncompiled rect { fill: #fff3bf; stroke: #e67700; }
svg.graph .node:hover rect, svg.graph .lit rect { stroke: #000 !important; stroke-width: 3; }
svg.lanes text { font-family: "DejaVu Sans Mono", "Liberation Mono", monospace; font-size: 10px; }
svg.lanes .track { fill: #f8f9fa; stroke: #dee2e6; }
svg.lanes .span:hover { stroke: #000; }
div.launch { margin: 10px 0; }
#info { position: fixed; right: 12px; bottom: 12px; max-width: 380px; background: #fff;
        border: 1px solid #adb5bd; border-radius: 6px; padding: 6px 10px; white-space: pre-wrap;
        font-family: "DejaVu Sans Mono", monospace; font-size: 12px; display: none; }
"""

# Hovering an op shows its details and lights up every op of its region in every graph; a click
# on a region's row opens and scrolls to the first graph that holds it. The last lines count the
# ops and the launch lanes' spans the browser really laid out (a box of non-zero size), for the
# report's browser test.
SCRIPT = """
(function () {
  var info = document.getElementById('info');
  function light(region, on) {
    if (!region) return;
    document.querySelectorAll('g.node[data-region="' + region + '"]').forEach(function (n) {
      n.classList.toggle('lit', on); });
  }
  document.querySelectorAll('svg.graph g.node').forEach(function (n) {
    n.addEventListener('mouseenter', function () {
      light(n.dataset.region, true);
      info.textContent = n.querySelector('title').textContent; info.style.display = 'block'; });
    n.addEventListener('mouseleave', function () {
      light(n.dataset.region, false); info.style.display = 'none'; });
  });
  document.querySelectorAll('tr.region-row').forEach(function (row) {
    row.addEventListener('click', function () {
      var hit = document.querySelector('g.node[data-region="' + row.dataset.region + '"]');
      if (!hit) return;
      var box = hit.closest('details'); if (box) box.open = true;
      hit.scrollIntoView({block: 'center', inline: 'center'}); light(row.dataset.region, true);
    });
  });
  var drawn = 0;
  document.querySelectorAll('.scroll svg.graph g.node').forEach(function (n) {
    var box = n.getBoundingClientRect(); if (box.width > 0 && box.height > 0) drawn += 1; });
  document.body.setAttribute('data-rendered-ops', String(drawn));
  var spans = 0;
  document.querySelectorAll('svg.lanes rect.span').forEach(function (r) {
    var box = r.getBoundingClientRect(); if (box.width > 0 && box.height > 0) spans += 1; });
  document.body.setAttribute('data-rendered-spans', String(spans));
})();
"""
