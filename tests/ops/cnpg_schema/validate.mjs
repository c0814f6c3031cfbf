// Validates custom resources against a validator that @kubernetes-models compiled from an operator's CRD.
// argv[2]: the compiled schema module (…/_schemas/PostgresqlCnpgIoV1Cluster.js); stdin: a JSON array of
// resources; stdout: a JSON array holding, for each resource, its problems ("path: keyword {params}").
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const { validate } = await import(pathToFileURL(process.argv[2]).href);
const resources = JSON.parse(readFileSync(0, "utf8"));
const problems = resources.map((resource) => {
  if (validate(resource)) return [];
  return validate.errors.map((e) => `${e.instancePath || "/"}: ${e.keyword} ${JSON.stringify(e.params)}`);
});
process.stdout.write(JSON.stringify(problems));
