// Markdown to safe HTML: marked renders, highlight.js colours code, DOMPurify strips
// anything that could run (scripts, event handlers, javascript: links).
import { Marked } from "../vendor/marked.esm.js";
import DOMPurify from "../vendor/purify.es.mjs";
import hljs from "../vendor/highlight.min.js";

const escapeHtml = (s) =>
  s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

const marked = new Marked({
  gfm: true,
  renderer: {
    code({ text, lang }) {
      const language = (lang || "").split(/\s/)[0];
      const known = language && hljs.getLanguage(language);
      const body = known ? hljs.highlight(text, { language, ignoreIllegals: true }).value : escapeHtml(text);
      const cls = known ? ` class="hljs language-${escapeHtml(language)}"` : ' class="hljs"';
      return `<pre><code${cls}>${body}</code></pre>\n`;
    },
  },
});

/** The sanitized HTML of a markdown text (model output). */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text), { USE_PROFILES: { html: true } });
}

/** Replace `element`'s content with the rendered markdown. */
export function renderInto(element, text) {
  element.innerHTML = renderMarkdown(text);
}
