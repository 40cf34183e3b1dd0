// A small Markdown renderer for the chat page: fenced and inline code, headings, lists, quotes, rules, bold,
// italics, strike-through and http(s) links. The text is HTML-escaped first, so model output can never inject
// markup; an unterminated fence (an answer still streaming) renders as a code block up to the end.
"use strict";

const Markdown = (() => {
  const escape = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");

  function inline(text) {
    const codes = [];
    let s = escape(text).replace(/`([^`\n]+)`/g, (_, c) => `\u0000${codes.push(c) - 1}\u0000`);
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
      (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/~~([^~\n]+)~~/g, "<del>$1</del>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
  }

  function list(lines, ordered) {
    const tag = ordered ? "ol" : "ul";
    const items = lines.map((l) => `<li>${inline(l.replace(/^\s*(?:[-*+]|\d+[.)])\s+/, ""))}</li>`);
    return `<${tag}>${items.join("")}</${tag}>`;
  }

  function render(source) {
    const lines = source.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    const flush = () => {
      if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) {
        flush();
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        const lang = fence[1] ? ` class="language-${escape(fence[1])}"` : "";
        out.push(`<pre><code${lang}>${escape(code.join("\n"))}</code></pre>`);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flush();
        out.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`);
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); out.push("<hr>"); continue; }
      const ordered = /^\s*\d+[.)]\s+/.test(line);
      if (ordered || /^\s*[-*+]\s+/.test(line)) {
        flush();
        const items = [line];
        const same = ordered ? /^\s*\d+[.)]\s+/ : /^\s*[-*+]\s+/;
        while (i + 1 < lines.length && same.test(lines[i + 1])) items.push(lines[++i]);
        out.push(list(items, ordered));
        continue;
      }
      if (/^\s*>/.test(line)) {
        flush();
        const quoted = [line.replace(/^\s*>\s?/, "")];
        while (i + 1 < lines.length && /^\s*>/.test(lines[i + 1])) quoted.push(lines[++i].replace(/^\s*>\s?/, ""));
        out.push(`<blockquote>${render(quoted.join("\n"))}</blockquote>`);
        continue;
      }
      if (!line.trim()) { flush(); continue; }
      para.push(line);
    }
    flush();
    return out.join("\n");
  }

  return { render, escape };
})();
