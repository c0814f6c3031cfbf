"""`fedbroker provision project.yaml --out DIR`: one kit per participant, so a site joins from its own
network with nothing but its kit (the role NVFlare's provisioning plays).

    DIR/ca/                      the project's CA (its key signs certificates; it goes in no kit)
    DIR/provision-state.json     the record of what was issued (serials, validity, token digests, broker users)
    DIR/server/                  the coordinator and the aggregation service (and the broker's TLS): server
                                 certificates with their public and in-cluster names, the CA's CRL
                                 (crl.pem), the token tables (SHA-256 only), the broker's users, configs,
                                 start scripts, RabbitMQ's and Prometheus's configs for a host, and a
                                 Kubernetes overlay (`kubectl kustomize DIR/server`) that exposes AMQPS 5671
                                 and gRPC over TLS through LoadBalancer Services
    DIR/sites/<name>/            a data owner: the CA certificate, its token, its broker URL, worker.yaml,
                                 start.sh
    DIR/scientists/<name>/       a data scientist: the CA certificate, its token, fedbroker.yaml for the CLI

Every participant proves who it is twice: its bearer token, and the client certificate it presents for
mutual TLS (the services and the broker refuse a connection without one the project CA signed). A kit
holds only what its participant needs: its own private keys and no one else's (the CA's key stays in
DIR/ca); every secret file is 0600 and every kit folder 0700. Paths inside a kit's configs are relative to the kit
(its start script changes into it first). The project file is checked whole before anything is written,
every problem named by its field.

Later, `fedbroker provision add|renew|revoke|rotate-token --out DIR` works from the record and the CA, under the
same CA, changing only the files that must change, each written whole.

The modules, one job each: `project` (the project file), `authority` (the CA, its certificates and its CRL),
`configs` (what each process reads: its YAML config, the broker's users, rabbitmq.conf, Prometheus's scrape
config), `folder` (a kit's folder, its file modes, and replacing a file whole), `k8s` (the server kit's
Kubernetes overlay), `kits` (every kit, written whole or not at all), `state` (the record of what was issued),
`serverkit` (changes to an issued server kit), `lifecycle` (add, renew, revoke, rotate-token) and `command`
(the `fedbroker provision` verbs).
"""

from fedbroker.app.provision.kits import provision
from fedbroker.app.provision.project import Person, Project, Site, load_project, parse_project

__all__ = ["Person", "Project", "Site", "load_project", "parse_project", "provision"]
