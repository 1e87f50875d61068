// The playground goes through the public OpenAI routes, exactly as a client would.

import { call, explain, sse } from "./api.js";

const $ = (id) => document.getElementById(id);

export function setupPlayground() {
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    chat();
  });
  $("embed-form").addEventListener("submit", (event) => {
    event.preventDefault();
    embed();
  });
}

// Keep each select's choice while the list of models changes under it.
export function fillModels(select, ids) {
  const current = select.value;
  const same = ids.length === select.options.length && ids.every((id, i) => select.options[i].value === id);
  if (same) return;
  select.replaceChildren(...ids.map((id) => new Option(id, id)));
  if (ids.includes(current)) select.value = current;
}

async function chat() {
  const reply = $("chat-reply"), stats = $("chat-stats"), button = $("chat-send");
  reply.textContent = "";
  stats.textContent = "waiting for the first token…";
  button.disabled = true;
  const started = performance.now();
  let first = null, chunks = 0, usage = null;
  try {
    const body = {
      model: $("chat-model").value,
      messages: [{ role: "user", content: $("chat-message").value }],
      stream: true,
      stream_options: { include_usage: true },
    };
    for await (const data of sse("/v1/chat/completions", { method: "POST", body })) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const text = chunk.choices?.[0]?.delta?.content;
      if (!text) continue;
      first ??= performance.now();
      chunks += 1;
      reply.textContent += text;
      stats.textContent = `TTFT ${((first - started) / 1000).toFixed(2)} s · ${chunks} tokens`;
    }
    const tokens = usage?.completion_tokens ?? chunks;
    const ttft = first === null ? null : (first - started) / 1000;
    const decode = first === null ? 0 : (performance.now() - first) / 1000;
    stats.textContent = ttft === null
      ? "no tokens"
      : `TTFT ${ttft.toFixed(2)} s · ${tokens} tokens · ${decode > 0 ? ((tokens - 1) / decode).toFixed(1) : "–"} tok/s`;
  } catch (error) {
    stats.textContent = `Refused: ${explain(error)}`;
  } finally {
    button.disabled = false;
  }
}

function cosine(a, b) {
  let dot = 0, na = 0, nb = 0;
  for (let i = 0; i < a.length; i++) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return dot / Math.sqrt(na * nb);
}

async function embed() {
  const result = $("embed-result");
  result.textContent = "…";
  try {
    const body = { model: $("embed-model").value, input: [$("embed-a").value, $("embed-b").value] };
    const { data } = await call("/v1/embeddings", { method: "POST", body });
    const [a, b] = data.sort((p, q) => p.index - q.index).map((d) => d.embedding);
    result.textContent = `Cosine similarity: ${cosine(a, b).toFixed(4)}`;
  } catch (error) {
    result.textContent = `Refused: ${explain(error)}`;
  }
}
