-- Runs the rendered guard (its path is the first argument) outside Envoy, with a shim of the parts of Envoy's
-- Lua handle API the guard calls: headers():get/getNumValues, body():length/getBytes, respond. Requests come
-- on stdin, length-prefixed: "<n headers>\n", then per header "<name bytes> <value bytes>\n<name><value>",
-- then "<body bytes>\n<body>". Each answer on stdout: "PASS\n", or "<status> <bytes>\n<body>".
dofile(arg[1])

local function read_sized(n)
  if n == 0 then return "" end
  return io.read(n)
end

while true do
  local count = io.read("*n")
  if count == nil then break end
  io.read("*l")
  local names, values = {}, {}
  for k = 1, count do
    local name_size, value_size = io.read("*n", "*n")
    io.read("*l")
    names[k] = string.lower(read_sized(name_size))
    values[k] = read_sized(value_size)
  end
  local body_size = io.read("*n")
  io.read("*l")
  local body = read_sized(body_size)
  local headers = {}
  function headers:get(name)
    for k = 1, count do if names[k] == name then return values[k] end end
    return nil
  end
  function headers:getNumValues(name)
    local n = 0
    for k = 1, count do if names[k] == name then n = n + 1 end end
    return n
  end
  local buffered = {}
  function buffered:length() return #body end
  function buffered:getBytes(start, size) return string.sub(body, start + 1, start + size) end
  local reply = nil
  local handle = {}
  function handle:headers() return headers end
  function handle:body() return buffered end
  function handle:respond(reply_headers, reply_body)
    reply = reply_headers[":status"] .. " " .. #reply_body .. "\n" .. reply_body
  end
  envoy_on_request(handle)
  io.write(reply or "PASS\n")
  io.flush()
end
