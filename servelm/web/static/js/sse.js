// Server-sent events parsing for fetch() streams. EventSource cannot POST a body
// or send an Authorization header, so the chat page reads the stream itself.

/** Splits SSE text, fed in arbitrary chunks, into the data of each complete event. */
export class SSEParser {
  constructor() {
    this.buffer = "";
    this.data = [];
  }

  /** Feed one chunk of decoded text; returns the data strings of the events it completed. */
  push(text) {
    this.buffer += text;
    const events = [];
    for (;;) {
      const end = this.buffer.search(/\r\n|\r|\n/);
      if (end < 0) break;
      // A "\r" that ends the buffer may be the first half of "\r\n": wait for the next chunk.
      if (this.buffer[end] === "\r" && end === this.buffer.length - 1) break;
      const line = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + (this.buffer.startsWith("\r\n", end) ? 2 : 1));
      this.line(line, events);
    }
    return events;
  }

  line(line, events) {
    if (line === "") {
      if (this.data.length) events.push(this.data.join("\n"));
      this.data = [];
      return;
    }
    if (line.startsWith(":")) return; // a comment (keep-alive)
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
  }
}
