// Validates Gateway API, prometheus-operator and GKE objects with the JSON-schema validators of
// @kubernetes-models/gateway-api, /prometheus-operator and /gke (pinned in package-lock.json; see
// ../SOURCES.md for what those schemas are and are not).
// stdin: a JSON array of objects. stdout: a JSON array, one {"ok": bool, "errors": [...]} per object.
// Exit 0 when every object is valid, 1 when one is not, 2 on a usage error.
import { readFileSync } from "node:fs";

// API group -> the package holding its models.
const PACKAGES = new Map([
  ["gateway.networking.k8s.io", "@kubernetes-models/gateway-api"],
  ["gateway.networking.x-k8s.io", "@kubernetes-models/gateway-api"],
  ["monitoring.coreos.com", "@kubernetes-models/prometheus-operator"],
  ["networking.gke.io", "@kubernetes-models/gke"],
]);
const SAFE = /^[A-Za-z0-9.]+$/;

async function check(object) {
  const apiVersion = String(object?.apiVersion ?? "");
  const kind = String(object?.kind ?? "");
  const [group, version] = apiVersion.split("/");
  const pkg = PACKAGES.get(group);
  if (!pkg || !version || !SAFE.test(version) || !SAFE.test(kind)) {
    return { ok: false, errors: [`no schema for ${apiVersion} ${kind}`] };
  }
  let Model;
  try {
    Model = (await import(`${pkg}/${group}/${version}/${kind}`))[kind];
  } catch {
    Model = undefined;
  }
  if (typeof Model !== "function") {
    return { ok: false, errors: [`no schema for ${apiVersion} ${kind}`] };
  }
  try {
    new Model(object).validate();
    return { ok: true, errors: [] };
  } catch (error) {
    return { ok: false, errors: [String(error?.message ?? error)] };
  }
}

let objects;
try {
  objects = JSON.parse(readFileSync(0, "utf8"));
} catch (error) {
  process.stderr.write(`expected a JSON array on stdin: ${error}\n`);
  process.exit(2);
}
if (!Array.isArray(objects)) {
  process.stderr.write("expected a JSON array on stdin\n");
  process.exit(2);
}
const results = [];
for (const object of objects) {
  results.push(await check(object));
}
process.stdout.write(JSON.stringify(results) + "\n");
process.exit(results.every((r) => r.ok) ? 0 : 1);
