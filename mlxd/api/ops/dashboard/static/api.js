// Talking to the daemon: the server key (asked once, kept in sessionStorage), JSON calls,
// and server-sent events read with fetch (EventSource cannot send an Authorization header).

const KEY = "mlxd.serverKey";

export const key = {
  get: () => sessionStorage.getItem(KEY) || "",
  set: (value) => (value ? sessionStorage.setItem(KEY, value) : sessionStorage.removeItem(KEY)),
};

export function headers(extra = {}) {
  const value = key.get();
  return value ? { ...extra, Authorization: `Bearer ${value}` } : extra;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// Why a call was refused, in words a user can act on.
export function explain(error) {
  if (error.status === 401) {
    return key.get()
      ? `401: the daemon rejected this key (${error.message}). Enter a server key (server.api_keys).`
      : `401: this daemon requires an API key (${error.message}). Enter a server key (server.api_keys) above.`;
  }
  if (error.status === 403) {
    return `403: ${error.message}. Actions and the dashboard's data need a server key, not a model key.`;
  }
  return error.status ? `${error.status}: ${error.message}` : String(error.message || error);
}

async function failure(response) {
  let message = response.statusText;
  try {
    const body = await response.json();
    message = body.error?.message || message;
  } catch { /* not JSON */ }
  return new ApiError(response.status, message);
}

export async function call(path, { method = "GET", body } = {}) {
  const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return response.json();
}

// A multipart form (an audio upload) or a JSON body, answered by any content (audio, text).
export async function fetchOk(path, { form, body }) {
  const init = { method: "POST", headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  init.body = form ?? JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return response;
}

// Yields each `data:` payload of an SSE response as it arrives.
export async function* sse(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}
