-- pd-extproc client guard (rendered into Envoy's Lua filter by extproc/envoy/guard.py; see that module).
-- It reads a body the way the engine behind the route would (docs/security.md, "What the guard reads"):
-- a body FastAPI reads as JSON (fastapi/routing.py: no content-type, or email.message's application/json or
-- application/*+json) is scanned for the steering members, and a member whose last occurrence is set (not
-- null, nor {} where tolerated) is refused with our JSON 400. Where it cannot read what the engine would, it
-- refuses (fail closed): a body the scanner cannot follow (not UTF-8 JSON, too deep), a body SGLang would
-- decompress first (x-body-compressed), a form that may carry a field vLLM decodes as JSON (vllm_xargs).
-- The placeholder below is replaced by the rendered tables: WATCH (dotted path -> true), PARENTS (the dotted
-- prefixes of the watched paths), LITERALS (their last keys), EMPTY_OK (paths where {} is tolerated), REFUSALS
-- (path -> body), INVALID_BODY, MEDIA_TYPE, UNINSPECTABLE (param -> body), FORM_JSON_FIELDS, and the
-- operator's loosenings ALLOW_COMPRESSED, ALLOW_FORM_JSON.
__TABLES__

local byte, find, sub, lower, char = string.byte, string.find, string.sub, string.lower, string.char
local MAX_DEPTH = 1000 -- CPython's json gives up near its recursion limit too

local ESCAPES = { [34] = '"', [92] = "\\", [47] = "/", [98] = "\b", [102] = "\f", [110] = "\n", [114] = "\r", [116] = "\t" }

-- The string starting at i (a quote). Returns its decoded text (non-ASCII escapes become \255, which no
-- watched name contains) and the position after it, or nil if it is not a valid JSON string.
local function read_string(s, i)
  local j, parts = i + 1, nil
  while true do
    local k = find(s, '[%z\1-\31"\\]', j)
    if not k then return nil end
    local c = byte(s, k)
    if c == 34 then
      if parts == nil then return sub(s, i + 1, k - 1), k + 1 end
      parts[#parts + 1] = sub(s, j, k - 1)
      return table.concat(parts), k + 1
    end
    if c ~= 92 then return nil end -- a raw control character: CPython's strict json refuses it
    parts = parts or {}
    parts[#parts + 1] = sub(s, j, k - 1)
    local e = byte(s, k + 1)
    if e == 117 then
      local hex = sub(s, k + 2, k + 5)
      if not find(hex, "^%x%x%x%x$") then return nil end
      local code = tonumber(hex, 16)
      parts[#parts + 1] = code < 128 and char(code) or "\255"
      j = k + 6
    elseif e ~= nil and ESCAPES[e] then
      parts[#parts + 1] = ESCAPES[e]
      j = k + 2
    else
      return nil
    end
  end
end

local function skip_ws(s, i)
  local _, e = find(s, "^[ \t\n\r]*", i)
  return e + 1
end

local scan_value

-- An object at i ("{"); path is its dotted path when it may hold a watched member, else nil.
-- Returns the position after it (nil for a bad body) and the watched path set in it, if any. A repeated
-- key counts once, with its last value, where it first appeared: what CPython's json and orjson build.
local function scan_object(s, i, path, depth)
  i = skip_ws(s, i + 1)
  if byte(s, i) == 125 then return i + 1 end
  local outcome, order = nil, nil -- key -> the watched path it sets, or false; keys in first-seen order
  while true do
    if byte(s, i) ~= 34 then return nil end
    local key, after = read_string(s, i)
    if key == nil then return nil end
    i = skip_ws(s, after)
    if byte(s, i) ~= 58 then return nil end
    i = skip_ws(s, i + 1)
    local full, child, here, tracked = nil, nil, nil, false
    if path ~= nil then
      full = path == "" and key or (path .. "." .. key)
      if WATCH[full] then
        local c = byte(s, i)
        if c == 110 and sub(s, i, i + 3) == "null" then
          -- null: not set, as for the P/D route
        elseif c == 123 and EMPTY_OK[full] and byte(s, skip_ws(s, i + 1)) == 125 then
          -- {}: tolerated where the P/D route tolerates it
        else
          here = full
        end
      end
      if PARENTS[full] then child = full end
      tracked = WATCH[full] or PARENTS[full]
    end
    local nxt, nested = scan_value(s, i, child, depth + 1)
    if nxt == nil then return nil end
    if tracked then -- a later null (or an object without the member) unsets an earlier value
      outcome, order = outcome or {}, order or {}
      if outcome[key] == nil then order[#order + 1] = key end
      outcome[key] = here or nested or false
    end
    i = skip_ws(s, nxt)
    local c = byte(s, i)
    if c == 125 then
      if order then
        for _, k in ipairs(order) do
          if outcome[k] then return i + 1, outcome[k] end
        end
      end
      return i + 1
    end
    if c ~= 44 then return nil end
    i = skip_ws(s, i + 1)
  end
end

scan_value = function(s, i, path, depth)
  if depth > MAX_DEPTH then return nil end
  local c = byte(s, i)
  if c == 123 then return scan_object(s, i, path, depth) end
  if c == 91 then
    i = skip_ws(s, i + 1)
    if byte(s, i) == 93 then return i + 1 end
    while true do
      local nxt = scan_value(s, i, nil, depth + 1)
      if nxt == nil then return nil end
      i = skip_ws(s, nxt)
      c = byte(s, i)
      if c == 93 then return i + 1 end
      if c ~= 44 then return nil end
      i = skip_ws(s, i + 1)
    end
  end
  if c == 34 then
    local text, after = read_string(s, i)
    if text == nil then return nil end
    return after
  end
  -- numbers, true, false, null, and CPython's NaN/Infinity: one token of these characters
  local _, e = find(s, "^[%w%.%+%-]+", i)
  if e == nil then return nil end
  return e + 1
end

-- Python's str.strip() on a header value (Starlette decodes it as latin-1): ASCII whitespace, the
-- separators \x1c-\x1f, NEL and NO-BREAK SPACE.
local PY_SPACE = "[\t-\r\28-\32\133\160]"
local function py_strip(value)
  return (value:gsub("^" .. PY_SPACE .. "+", ""):gsub(PY_SPACE .. "+$", ""))
end

-- What FastAPI reads as JSON (fastapi/routing.py get_request_handler: email.message's get_content_maintype
-- and get_content_subtype; no content-type is JSON too before its strict_content_type, as at TensorRT-LLM's
-- pin). email.message: the part before ";", stripped, lower-cased; not exactly one "/" is text/plain.
local function read_as_json(value)
  if value == nil or value == "" then return true end
  local media = lower(py_strip(value:match("^([^;]*)")))
  local main, subtype = media:match("^([^/]*)/([^/]*)$")
  if main ~= "application" then return false end
  return subtype == "json" or sub(subtype, -5) == "+json"
end

-- Starlette's form media types (requests.py _get_form with python-multipart's parse_options_header), read
-- loosely: any content-type naming either is treated as a form, since it is only ever refused more.
local function form_kind(value)
  local lowered = lower(value)
  if find(lowered, "multipart/form-data", 1, true) then return "multipart" end
  if find(lowered, "application/x-www-form-urlencoded", 1, true) then return "urlencoded" end
  return nil
end

-- The fast path: a body in which no watched name can appear is not scanned. A name appears either
-- literally or with a letter or "_" escaped (\u0041-\u007f); a body CPython's json.loads would decode
-- as UTF-16 or UTF-32 (json.detect_encoding: a BOM, or a NUL among the first four bytes) is scanned,
-- and refused, since the scanner reads UTF-8 only.
local function may_steer(s)
  local head = sub(s, 1, 4)
  if find(head, "%z") or find(head, "^\254\255") or find(head, "^\255\254") then return true end
  if find(s, "\\u00[4-7]") then return true end
  for _, name in ipairs(LITERALS) do
    if find(s, name, 1, true) then return true end
  end
  return false
end

local function unquote_plus(s)
  return (s:gsub("%+", " "):gsub("%%(%x%x)", function(hex) return char(tonumber(hex, 16)) end))
end

-- Charsets in which the ASCII bytes of a field name decode to the same name (Starlette's MultiPartParser
-- decodes names with the content-type's charset; codecs.lookup of an unknown one falls back to latin-1).
local ASCII_CHARSETS = { ["utf-8"] = true, ["utf8"] = true, ["us-ascii"] = true, ["ascii"] = true,
                         ["iso-8859-1"] = true, ["latin-1"] = true, ["latin1"] = true }

local function names_decode_as_ascii(content_type)
  for value in lower(content_type):gmatch('charset[ \t]*=[ \t]*"?([^";]*)') do
    if not ASCII_CHARSETS[value:match("^[ \t]*(.-)[ \t]*$")] then return false end
  end
  return true
end

-- A form field the engine decodes as JSON (vLLM's transcription and translation vllm_xargs), named where
-- the form parser would read it: a multipart part's name is taken as written (python-multipart
-- parse_options_header ignores name*= and unescapes only \\ and \"), unless a charset parameter other than an
-- ASCII-compatible one makes Starlette decode it otherwise; an urlencoded name is percent-decoded.
local function form_json_field(kind, content_type, s)
  if kind == "multipart" and not names_decode_as_ascii(content_type) then return "content-type" end
  local text = kind == "urlencoded" and unquote_plus(s) or s
  for _, name in ipairs(FORM_JSON_FIELDS) do
    if find(text, name, 1, true) then return name end
  end
  return nil
end

local function refuse(handle, status, body)
  handle:respond({[":status"] = status, ["content-type"] = "application/json"}, body)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get("x-body-compressed") ~= nil then
    if ALLOW_COMPRESSED then return end -- the operator's choice: passed unread
    return refuse(handle, "415", UNINSPECTABLE["x-body-compressed"]) -- SGLang would decompress it first
  end
  local content_type = headers:get("content-type")
  if headers:getNumValues("content-type") > 1 or (content_type ~= nil and find(content_type, ",", 1, true)) then
    return refuse(handle, "415", MEDIA_TYPE) -- which one would the engine read?
  end
  local json = read_as_json(content_type)
  local kind = not json and form_kind(content_type) or nil
  if not json and (kind == nil or ALLOW_FORM_JSON) then return end
  local buffered = handle:body()
  if buffered == nil then return end
  local size = buffered:length()
  if size == 0 then return end
  local s = buffered:getBytes(0, size)
  if kind ~= nil then
    local field = form_json_field(kind, content_type, s)
    if field ~= nil then return refuse(handle, "415", UNINSPECTABLE[field]) end
    return
  end
  if not may_steer(s) then return end
  local ok, nxt, found = pcall(function()
    local i = 1
    if sub(s, 1, 3) == "\239\187\191" then i = 4 end -- a UTF-8 BOM: CPython's json.loads skips it
    return scan_value(s, skip_ws(s, i), "", 0)
  end)
  if not ok or nxt == nil then return refuse(handle, "400", INVALID_BODY) end
  if found then return refuse(handle, "400", REFUSALS[found]) end
end
