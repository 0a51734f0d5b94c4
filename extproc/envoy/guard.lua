-- pd-extproc client guard (rendered into Envoy's Lua filter by extproc/envoy/guard.py; see that module).
-- A JSON body that an engine would read (FastAPI: no content-type, or application/json or
-- application/*+json in any case with any parameters) is scanned for the steering members; a member that
-- is present with a value other than null (or {} where tolerated) is refused with our JSON 400.
-- Fails closed: a body the scanner cannot follow (not UTF-8 JSON, too deep) is refused, never passed.
-- The placeholder below is replaced by the rendered tables: WATCH (dotted path -> true), PARENTS (the dotted
-- prefixes of the watched paths), LITERALS (their last keys), EMPTY_OK (paths where {} is tolerated), REFUSALS (path -> body),
-- INVALID_BODY, MEDIA_TYPE (bodies).
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
-- Returns the position after it, or nil plus a refusal (a REFUSALS key, or false for a bad body).
local function scan_object(s, i, path, depth)
  i = skip_ws(s, i + 1)
  if byte(s, i) == 125 then return i + 1 end
  while true do
    if byte(s, i) ~= 34 then return nil, false end
    local key, after = read_string(s, i)
    if key == nil then return nil, false end
    i = skip_ws(s, after)
    if byte(s, i) ~= 58 then return nil, false end
    i = skip_ws(s, i + 1)
    local full, child = nil, nil
    if path ~= nil then
      full = path == "" and key or (path .. "." .. key)
      if WATCH[full] then
        local c = byte(s, i)
        if c == 110 and sub(s, i, i + 3) == "null" then
          -- null: not set, as for the P/D route
        elseif c == 123 and EMPTY_OK[full] and byte(s, skip_ws(s, i + 1)) == 125 then
          -- {}: tolerated where the P/D route tolerates it
        else
          return nil, full
        end
      end
      if PARENTS[full] then child = full end
    end
    local nxt, refusal = scan_value(s, i, child, depth + 1)
    if nxt == nil then return nil, refusal end
    i = skip_ws(s, nxt)
    local c = byte(s, i)
    if c == 125 then return i + 1 end
    if c ~= 44 then return nil, false end
    i = skip_ws(s, i + 1)
  end
end

scan_value = function(s, i, path, depth)
  if depth > MAX_DEPTH then return nil, false end
  local c = byte(s, i)
  if c == 123 then return scan_object(s, i, path, depth) end
  if c == 91 then
    i = skip_ws(s, i + 1)
    if byte(s, i) == 93 then return i + 1 end
    while true do
      local nxt, refusal = scan_value(s, i, nil, depth + 1)
      if nxt == nil then return nil, refusal end
      i = skip_ws(s, nxt)
      c = byte(s, i)
      if c == 93 then return i + 1 end
      if c ~= 44 then return nil, false end
      i = skip_ws(s, i + 1)
    end
  end
  if c == 34 then
    local text, after = read_string(s, i)
    if text == nil then return nil, false end
    return after
  end
  -- numbers, true, false, null, and CPython's NaN/Infinity: one token of these characters
  local _, e = find(s, "^[%w%.%+%-]+", i)
  if e == nil then return nil, false end
  return e + 1
end

-- What FastAPI reads as JSON (fastapi/routing.py: email.message's content type).
local function read_as_json(value)
  if value == nil or value == "" then return true end
  local media = lower(value:match("^([^;]*)")):match("^%s*(.-)%s*$")
  local main, subtype = media:match("^([^/]*)/([^/]*)$")
  if main ~= "application" then return false end
  return subtype == "json" or sub(subtype, -5) == "+json"
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

local function refuse(handle, status, body)
  handle:respond({[":status"] = status, ["content-type"] = "application/json"}, body)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local content_type = headers:get("content-type")
  if headers:getNumValues("content-type") > 1 or (content_type ~= nil and find(content_type, ",", 1, true)) then
    return refuse(handle, "415", MEDIA_TYPE) -- which one would the engine read?
  end
  if not read_as_json(content_type) then return end
  local buffered = handle:body()
  if buffered == nil then return end
  local size = buffered:length()
  if size == 0 then return end
  local s = buffered:getBytes(0, size)
  if not may_steer(s) then return end
  local ok, nxt, refusal = pcall(function()
    local i = 1
    if sub(s, 1, 3) == "\239\187\191" then i = 4 end -- a UTF-8 BOM: CPython's json.loads skips it
    return scan_value(s, skip_ws(s, i), "", 0)
  end)
  if not ok or nxt == nil and not refusal then return refuse(handle, "400", INVALID_BODY) end
  if nxt == nil then return refuse(handle, "400", REFUSALS[refusal]) end
end
