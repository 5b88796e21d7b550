// The kvmem plan page: a form built from `kvmem plan`'s flags (/api/form), kept in the
// address bar's query string under the flags' names, and the plan the server computes for
// it (/api/view). Nothing here plans or formats figures beyond grouping digits: every
// number and sentence comes from the server, as the command line prints it.
"use strict";

const EXAMPLE = "model=Qwen%2FQwen3-32B&pp=2&layer_partition=56%2C8&kv_cache_dtype=fp8" +
  "&kv_cache_memory_bytes=5GiB&max_model_len=40960&kv_budget=proportional";
const CONFIG = "config";  // a pasted config.json: the one input that is no flag
const OPEN_GROUPS = ["model", "layout", "output"];  // others open when they hold a value
const $ = (id) => document.getElementById(id);
const fields = new Map();  // name -> {control, field}
let latest = 0;            // the newest request; older answers are dropped
let inFlight = null;
let timer = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children);
  return node;
}

const count = (n) => Number(n).toLocaleString("en-US");

// ---- the form, from the flags -------------------------------------------------------

function datalist(id, options) {
  const list = el("datalist", {id});
  for (const [value, label] of options) list.append(el("option", {value, label}));
  return list;
}

function control(f, lists) {
  const id = `f-${f.name}`;
  const described = `h-${f.name} e-${f.name}`;
  if (f.kind === "switch") {
    return el("input", {type: "checkbox", id, name: f.name, "aria-describedby": described});
  }
  if (f.kind === "choice") {
    const select = el("select", {id, name: f.name, "aria-describedby": described});
    for (const choice of f.choices) {
      select.append(el("option", {value: choice, text: choice, selected: choice === f.default}));
    }
    return select;
  }
  const numeric = /^(N|F|GiB)$/.test(f.metavar || "");
  return el("input", {
    type: "text", id, name: f.name, placeholder: f.default ?? "", spellcheck: "false",
    inputmode: numeric ? "decimal" : null, list: lists[f.name] ?? null,
    "aria-describedby": described,
  });
}

function fieldBlock(f, lists) {
  const input = control(f, lists);
  const label = el("label", {for: input.id},
    el("code", {text: f.flag ?? "MODEL"}));
  const help = el("p", {class: "help", id: `h-${f.name}`, text: f.help});
  const error = el("p", {class: "error", id: `e-${f.name}`, hidden: true});
  const block = el("div", {class: f.kind === "switch" ? "field switch" : "field"},
    f.kind === "switch" ? el("div", {class: "row"}, input, label) : label,
    f.kind === "switch" ? "" : input, help, error);
  fields.set(f.name, {control: input, field: f, block});
  return block;
}

function configBlock() {
  const input = el("textarea", {id: "f-config", name: CONFIG, rows: "5", spellcheck: "false",
    "aria-describedby": "h-config e-config"});
  const block = el("details", {class: "field", id: "config-details"},
    el("summary", {text: "or paste a config.json"}),
    el("label", {for: "f-config", class: "visually-hidden", text: "config.json"}), input,
    el("p", {class: "help", id: "h-config",
      text: "A HuggingFace config.json, planned instead of a catalog model; MODEL then " +
            "names it in the command"}),
    el("p", {class: "error", id: "e-config", hidden: true}));
  fields.set(CONFIG, {control: input, field: {name: CONFIG, kind: "text"}, block});
  return block;
}

function buildForm(spec) {
  const form = $("inputs");
  form.replaceChildren();
  form.append(
    datalist("models", spec.models.map((m) => [m.id, m.aliases.join(", ")])),
    datalist("gpus", spec.gpus.map((g) => [g.name, `${g.gib} GiB`])),
    datalist("kv-dtypes", spec.kv_dtypes.map((d) => [d, d])));
  const lists = {model: "models", gpu: "gpus", kv_cache_dtype: "kv-dtypes"};
  for (const group of spec.groups) {
    const box = el("details", {class: "group", open: OPEN_GROUPS.includes(group.title)});
    box.append(el("summary", {text: group.title}));
    for (const f of group.fields) box.append(fieldBlock(f, lists));
    if (group.title === "model") box.append(configBlock());
    form.append(box);
  }
  form.addEventListener("input", (event) => {
    if (event.target.matches("input[type=text], textarea")) schedule(250);
  });
  form.addEventListener("change", () => schedule(0));
  form.addEventListener("submit", (event) => { event.preventDefault(); schedule(0); });
}

// ---- state in the query string ------------------------------------------------------

function readForm() {
  const query = new URLSearchParams();
  for (const [name, {control, field}] of fields) {
    if (field.kind === "switch") {
      if (control.checked) query.append(name, "true");
    } else if (field.kind === "choice") {
      if (control.value !== field.default) query.append(name, control.value);
    } else if (control.value.trim() !== "") {
      query.append(name, control.value);
    }
  }
  return query;
}

function writeForm(query) {
  for (const [name, {control, field}] of fields) {
    const values = query.getAll(name);
    if (field.kind === "switch") control.checked = ["true", "1", "on", "yes"]
      .includes((values.at(-1) ?? "").toLowerCase());
    else if (field.kind === "choice") control.value = values.at(-1) ?? field.default ?? field.choices[0];
    else control.value = values.join(",");
  }
  for (const {control, field, block} of fields.values()) {  // open each group with a value
    const set = field.kind === "switch" ? control.checked
      : field.kind === "choice" ? control.value !== (field.default ?? field.choices[0])
      : control.value !== "";
    if (set) block.closest("details.group").open = true;
    if (set && field.name === CONFIG) block.open = true;
  }
  // flags the page does not show still reach the server, which names them
  return [...query.keys()].filter((key) => !fields.has(key));
}

function schedule(delay) {
  clearTimeout(timer);
  timer = setTimeout(update, delay);
}

// ---- asking the planner -------------------------------------------------------------

async function update(extra = []) {
  const query = readForm();
  for (const [key, value] of extra) query.append(key, value);
  const text = query.toString();
  history.replaceState(null, "", text ? `?${text}` : location.pathname);
  const id = ++latest;
  if (inFlight) inFlight.abort();
  inFlight = new AbortController();
  $("results").setAttribute("aria-busy", "true");
  let answer;
  try {
    const response = await fetch(`/api/view?${text}`, {signal: inFlight.signal});
    answer = {ok: response.ok, body: await response.json()};
  } catch (err) {
    if (err.name === "AbortError") return;
    answer = {ok: false, body: {error: `the planner did not answer (${err.message})`, field: null}};
  }
  if (id !== latest) return;
  $("results").setAttribute("aria-busy", "false");
  clearErrors();
  if (answer.ok) render(answer.body, text);
  else showError(answer.body);
}

function clearErrors() {
  for (const {control} of fields.values()) control.removeAttribute("aria-invalid");
  for (const node of document.querySelectorAll(".field .error")) {
    node.hidden = true;
    node.textContent = "";
  }
  $("problem").hidden = true;
}

function showError({error, field}) {
  $("plan").hidden = true;
  const problem = $("problem");
  problem.replaceChildren();
  const target = field && fields.get(field);
  if (target) {
    const message = $(`e-${field}`);
    message.textContent = error;
    message.hidden = false;
    target.control.setAttribute("aria-invalid", "true");
    for (let node = target.block; node; node = node.parentElement) {
      if (node.tagName === "DETAILS") node.open = true;
    }
    const label = target.field.flag ?? (field === CONFIG ? "config.json" : "MODEL");
    const link = el("a", {href: `#f-${field}`, text: label});
    link.addEventListener("click", (event) => { event.preventDefault(); target.control.focus(); });
    problem.append("No plan: ", link, " is refused (the reason is next to it).");
  } else {
    problem.append(el("strong", {text: "No plan: "}), error);
  }
  problem.hidden = false;
}

// ---- drawing the plan ---------------------------------------------------------------

function render(view, query) {
  const doc = view.plan;
  const e = doc.engine;
  const verdict = $("verdict");
  verdict.className = view.fits ? "fits" : "no-fit";
  verdict.textContent = `${view.fits ? "Fits" : "Does not fit"}: ${count(e.num_blocks)} ` +
    `blocks, ${count(e.tokens)} tokens, ${e.max_concurrency.toFixed(2)}x requests of ` +
    `${count(e.max_model_len)} tokens (${e.policy} budget)`;
  drawBars(view.bars);
  drawRanks(view.ranks);
  $("summary").replaceChildren(...view.summary.flatMap(([term, value]) =>
    [el("dt", {text: term}), el("dd", {text: value})]));
  $("vllm-log").textContent = view.vllm_log;
  $("elastic").hidden = view.elastic.length === 0;
  $("elastic").textContent = view.elastic.join("\n");
  drawCommands(view.commands);
  listInto($("warnings"), view.warnings, "None.");
  listInto($("alternatives"), view.alternatives,
    view.fits ? "Nothing needed: the plan fits." : "Nothing the planner tried fits.");
  $("json-link").href = `/api/plan?${query}`;
  $("plan").hidden = false;
}

function drawBars(bars) {
  const totals = bars.ranks.map((r) => r.gib.reduce((a, b) => a + b, 0));
  const scale = Math.max(...totals, ...bars.ranks.map((r) => r.memory_gib ?? 0), 1e-9);
  const rows = bars.ranks.map((rank, i) => {
    const words = bars.parts.map((p, j) => `${p.label} ${rank.gib[j].toFixed(2)} GiB`);
    if (rank.memory_gib !== null) words.push(`device memory ${rank.memory_gib.toFixed(2)} GiB`);
    const bar = el("div", {class: "bar", role: "img",
      "aria-label": `${rank.label}: ${words.join(", ")}`});
    bars.parts.forEach((part, j) => {
      if (rank.gib[j] <= 0) return;
      const seg = el("span", {class: "seg", title: words[j]});
      seg.style.width = `${(100 * rank.gib[j]) / scale}%`;
      seg.style.backgroundColor = part.color;
      bar.append(seg);
    });
    if (rank.memory_gib !== null) {
      const mark = el("span", {class: "device", title: words.at(-1)});
      mark.style.left = `calc(${(100 * rank.memory_gib) / scale}% - 1px)`;
      bar.append(mark);
    }
    return el("div", {class: "bar-row"}, el("span", {class: "bar-label", text: rank.label}),
      bar, el("span", {class: "bar-total", text: `${totals[i].toFixed(2)} GiB`}));
  });
  $("bars").replaceChildren(...rows);
  const legend = bars.parts.map((part) => {
    const swatch = el("span", {class: "swatch", "aria-hidden": "true"});
    swatch.style.backgroundColor = part.color;
    return el("li", {}, swatch, part.label);
  });
  if (bars.ranks.some((r) => r.memory_gib !== null)) {
    legend.push(el("li", {}, el("span", {class: "swatch device-key", "aria-hidden": "true"}),
      "device memory"));
  }
  $("legend").replaceChildren(...legend);
}

function drawRanks(ranks) {
  $("ranks").tBodies[0].replaceChildren(...ranks.map((r) => el("tr", {},
    el("td", {text: r.rank}), el("td", {text: r.pp_stage}), el("td", {text: r.tp_rank}),
    el("td", {text: r.layers}), el("td", {text: count(r.blocks)}),
    el("td", {text: count(r.tokens)}),
    el("td", {class: r.fits ? "fits" : "no-fit", text: r.fits ? "yes" : "no"}),
    el("td", {text: r.need}), el("td", {text: r.budget}), el("td", {text: count(r.longest)}))));
}

function drawCommands(commands) {
  const box = $("commands");
  box.replaceChildren();
  if (commands.length === 0) {
    box.append(el("p", {text: "Choose an engine (--engine) to see its command."}));
    return;
  }
  commands.forEach((cmd, i) => {
    const code = el("code", {id: `cmd-${i}`, text: cmd.shell});
    const status = el("span", {class: "copied", role: "status"});
    const button = el("button", {type: "button", class: "copy", "aria-describedby": `cmd-${i}`,
      text: "Copy"});
    button.addEventListener("click", () => copy(cmd.shell, button, status));
    box.append(el("h4", {text: cmd.title}),
      el("div", {class: "command"}, el("pre", {}, code), el("div", {}, button, status)));
    if (cmd.notes.length) listInto(box.appendChild(el("ul", {class: "notes"})), cmd.notes);
  });
}

function listInto(list, items, empty) {
  list.replaceChildren(...items.map((text) => el("li", {text})));
  if (items.length === 0 && empty) list.append(el("li", {class: "none", text: empty}));
}

async function copy(text, button, status) {
  let done = false;
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      done = true;
    } catch (err) { /* not allowed here: the selection below */ }
  }
  if (!done) {  // plain http from another machine is no secure context
    const area = el("textarea", {readonly: true, class: "offscreen"});
    area.value = text;
    document.body.append(area);
    area.select();
    done = document.execCommand("copy");
    area.remove();
    button.focus();
  }
  status.textContent = done ? "Copied" : "Copy failed: select the command and copy it";
  setTimeout(() => { status.textContent = ""; }, 4000);
}

// ---- start --------------------------------------------------------------------------

async function start() {
  try {
    buildForm(await (await fetch("/api/form")).json());
  } catch (err) {
    $("form-loading").textContent = `The planner did not answer (${err.message}).`;
    return;
  }
  const query = new URLSearchParams(location.search || EXAMPLE);
  const unknown = writeForm(query);
  update(unknown.flatMap((key) => query.getAll(key).map((value) => [key, value])));
}

start();
